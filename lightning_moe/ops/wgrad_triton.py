"""Grouped weight-gradient GEMM that adds into the existing gradient, one Triton launch for all experts.

Legend: R rows grouped by expert, D input width, O output width, E experts.

    dw_EDO[e] += x_RD[rows of e]^T @ dy_RO[rows of e]        (fp32 accumulation, one rounding)

One program per ``(expert, D tile, O tile)``, experts outermost so that an expert's rows (a few
MB) stay in L2 while all its tiles read them; the old gradient tile is read and the sum written
once. Row ranges come from the device offsets: no host sync, one launch instead of one GEMM per
expert. Experts without rows return at once and leave their gradient untouched.

Opt-in (``LIGHTNING_MOE_WGRAD_KERNEL=triton``) and Triton optional: :func:`supported` says when
this path can run (CUDA tensors and an importable Triton; ``TRITON_INTERPRET=1`` runs it on CPU
tensors for tests). On the H200 it is correct but slower than the default, one cuBLAS ``addmm_``
per expert (``ops/wgrad_accumulation.py``): 27.5 ms for DeepSeek-V3's two weights, where the
memory traffic of reading and writing the 22.5 GB gradient once bounds it near 10 ms. A starting
point for a tuned kernel (TMA loads, a persistent schedule), not the default.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

__all__ = ["grouped_wgrad_accumulate_", "supported"]

# (BLOCK_D, BLOCK_O, BLOCK_R, num_warps, num_stages) tried once per (D, O) on the GPU.
_CONFIGS = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on tensors like ``x``."""
    if importlib.util.find_spec("triton") is None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (_interpreting() and x.device.type == "cpu")


@functools.cache
def _kernel(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def wgrad_accumulate(
        x_ptr, dy_ptr, dw_ptr, offs_ptr, D, O, stride_x, stride_dy,
        BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        tiles_o = (O + BLOCK_O - 1) // BLOCK_O
        per_expert = (D + BLOCK_D - 1) // BLOCK_D * tiles_o
        e = pid // per_expert
        td = (pid % per_expert) // tiles_o
        to = pid % tiles_o
        end = tl.load(offs_ptr + e).to(tl.int64)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
        if end > start:
            rd = td * BLOCK_D + tl.arange(0, BLOCK_D)
            ro = to * BLOCK_O + tl.arange(0, BLOCK_O)
            acc = tl.zeros((BLOCK_D, BLOCK_O), dtype=tl.float32)
            for r0 in range(start, end, BLOCK_R):
                rr = r0 + tl.arange(0, BLOCK_R)
                xt = tl.load(  # [BLOCK_D, BLOCK_R]: x's rows of this expert, transposed
                    x_ptr + rr[None, :] * stride_x + rd[:, None],
                    mask=(rr[None, :] < end) & (rd[:, None] < D), other=0.0,
                )  # fmt: skip
                g = tl.load(
                    dy_ptr + rr[:, None] * stride_dy + ro[None, :],
                    mask=(rr[:, None] < end) & (ro[None, :] < O), other=0.0,
                )  # fmt: skip
                if IEEE:
                    acc += tl.dot(xt, g, input_precision="ieee")
                else:
                    acc += tl.dot(xt, g)
            tile = dw_ptr + e.to(tl.int64) * D * O + rd[:, None] * O + ro[None, :]
            inside = (rd[:, None] < D) & (ro[None, :] < O)
            old = tl.load(tile, mask=inside, other=0.0).to(tl.float32)
            tl.store(tile, (old + acc).to(dw_ptr.dtype.element_ty), mask=inside)

    if interpret:
        return wgrad_accumulate, None
    configs = [
        triton.Config({"BLOCK_D": d, "BLOCK_O": o, "BLOCK_R": r}, num_warps=w, num_stages=s)
        for d, o, r, w, s in _CONFIGS
    ]
    # Each candidate adds into dw while being timed: autotuning restores it before every run.
    tuned = triton.autotune(configs, key=["D", "O"], restore_value=["dw_ptr"])(wgrad_accumulate)
    return wgrad_accumulate, tuned


def grouped_wgrad_accumulate_(
    dw_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor
) -> None:
    """``dw_EDO[e] += x_e^T @ dy_e`` for every expert; ``offs_E`` inclusive row ends (device)."""
    E, D, O = dw_EDO.shape
    if x_RD.shape[0] == 0 or E == 0:
        return
    x_RD = x_RD.contiguous()
    dy_RO = dy_RO.contiguous()
    offs = offs_E.to(torch.int32).contiguous()
    interpret = _interpreting() and not x_RD.is_cuda
    plain, tuned = _kernel(interpret)
    ieee = x_RD.dtype == torch.float32
    args = (x_RD, dy_RO, dw_EDO, offs, D, O, x_RD.stride(0), dy_RO.stride(0))

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (E * -(-D // meta["BLOCK_D"]) * -(-O // meta["BLOCK_O"]),)

    if tuned is None:  # the interpreter: one configuration, small blocks
        plain[grid](*args, BLOCK_D=32, BLOCK_O=32, BLOCK_R=16, IEEE=ieee)
    else:
        tuned[grid](*args, IEEE=ieee)
