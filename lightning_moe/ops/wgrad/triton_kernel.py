"""Grouped weight-gradient GEMM that adds into the existing gradient, one Triton launch for all experts.

Legend: R rows grouped by expert, D input width, O output width, E experts.

    dw_EDO[e] += x_RD[rows of e]^T @ dy_RO[rows of e]        (fp32 accumulation, one rounding)

One program per ``(expert, D tile, O tile)``, experts outermost so that an expert's rows (a few
MB) stay in L2 while all its tiles read them. The old gradient tile is requested before the
reduction over rows starts (``c_load``): with a few hundred rows per expert the reduction is a
handful of MMA steps, and a tile that first reduces and then reads its old gradient leaves the
memory system idle half the time. Row ranges come from the device offsets: no host sync, one
launch instead of one GEMM per expert. Experts without rows return at once and leave their
gradient untouched.

Opt-in (``KernelConfig(wgrad="triton")``) and Triton optional: :func:`supported` says when
this path can run (CUDA tensors and an importable Triton; ``TRITON_INTERPRET=1`` runs it on CPU
tensors for tests; read once per process). The tile is fixed per call (:class:`WgradTile`, by
dtype unless the caller passes one), not autotuned: autotuning a kernel that adds in place must
save and restore the whole gradient (15 GB for one DeepSeek-V3 weight) on its first step.
``benchmarks/probes/wgrad_kernels.py`` times tiles against the cuBLAS loop.

Measured on the H200 (Triton 3.6, 22 tiles, DeepSeek-V3's two weights): the best,
128x128x32 with 4 warps, 4 stages, "init", 22.3 ms against the one-stream cuBLAS loop's 22.6
and the two-stream loop's ~19; reading the old tile early, through TMA, or with a persistent
grid changed nothing or lost. Every variant moves the gradient at ~2 TB/s, half of what the
memory allows: each tile reduces a few hundred rows, then waits on its gradient's read and
write, and nothing overlaps one tile's epilogue with the next tile's MMAs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, NamedTuple

import torch

__all__ = ["WgradTile", "grouped_wgrad_accumulate_", "supported", "tile_for"]


class WgradTile(NamedTuple):
    """One launch configuration of the grouped kernel."""

    block_d: int = 128
    block_o: int = 128
    block_r: int = 64
    warps: int = 4
    stages: int = 3
    # When the old gradient tile is read: "init" (the reduction starts from it), "early" (before the
    # reduction, added after it), "late" (after the reduction) or "tma" (like "early", but read and
    # written by the tensor-memory accelerator through shared memory, no registers held while in
    # flight; needs D divisible by block_d, else "early").
    c_load: str = "init"
    # Programs per SM of a persistent grid; 0: one program per tile.
    programs_per_sm: int = 0

    def label(self) -> str:
        grid = f" p{self.programs_per_sm}" if self.programs_per_sm else ""
        return f"{self.block_d}x{self.block_o}x{self.block_r} w{self.warps} s{self.stages} {self.c_load}{grid}"


_C_LOADS = ("init", "early", "late", "tma")


def tile_for(dtype: torch.dtype) -> WgradTile:
    """The tile used when the caller names none, by dtype."""
    if dtype == torch.float32:
        return WgradTile(64, 64, 32, 4, 2)
    return WgradTile()


@functools.cache
def _interpreting() -> bool:
    """Triton's own switch for its CPU interpreter, read once per process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on tensors like ``x``."""
    if importlib.util.find_spec("triton") is None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (_interpreting() and x.device.type == "cpu")


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 1 for the CPU (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def wgrad_accumulate(
        x_ptr, dy_ptr, dw_ptr, dw_desc, offs_ptr, E, D, O, stride_x, stride_dy,
        BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
        C_LOAD: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        tiles_o = tl.cdiv(O, BLOCK_O)
        per_expert = tl.cdiv(D, BLOCK_D) * tiles_o
        # One tile per program, or (a persistent grid) every num_programs-th tile.
        for t in range(tl.program_id(0), E * per_expert, tl.num_programs(0)):
            e = t // per_expert
            td = (t % per_expert) // tiles_o
            to = t % tiles_o
            end = tl.load(offs_ptr + e).to(tl.int64)
            start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
            if end > start:
                rd = td * BLOCK_D + tl.arange(0, BLOCK_D)
                ro = to * BLOCK_O + tl.arange(0, BLOCK_O)
                tile = dw_ptr + e.to(tl.int64) * D * O + rd[:, None] * O + ro[None, :]
                inside = (rd[:, None] < D) & (ro[None, :] < O)
                if C_LOAD == "tma":
                    old = dw_desc.load([e * D + td * BLOCK_D, to * BLOCK_O])
                elif C_LOAD != "late":  # in flight while the rows are reduced
                    if EVEN:
                        old = tl.load(tile)
                    else:
                        old = tl.load(tile, mask=inside, other=0.0)
                if C_LOAD == "init":
                    acc = old.to(tl.float32)
                else:
                    acc = tl.zeros((BLOCK_D, BLOCK_O), dtype=tl.float32)
                for r0 in range(start, end, BLOCK_R):
                    rr = r0 + tl.arange(0, BLOCK_R)
                    row_ok = rr[:, None] < end
                    if EVEN:
                        x = tl.load(x_ptr + rr[:, None] * stride_x + rd[None, :], mask=row_ok, other=0.0)
                        g = tl.load(dy_ptr + rr[:, None] * stride_dy + ro[None, :], mask=row_ok, other=0.0)
                    else:
                        x_ok = row_ok & (rd[None, :] < D)
                        g_ok = row_ok & (ro[None, :] < O)
                        x = tl.load(x_ptr + rr[:, None] * stride_x + rd[None, :], mask=x_ok, other=0.0)
                        g = tl.load(dy_ptr + rr[:, None] * stride_dy + ro[None, :], mask=g_ok, other=0.0)
                    if IEEE:
                        acc = tl.dot(tl.trans(x), g, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(tl.trans(x), g, acc)
                if C_LOAD == "late":
                    if EVEN:
                        old = tl.load(tile)
                    else:
                        old = tl.load(tile, mask=inside, other=0.0)
                if C_LOAD != "init":
                    acc += old.to(tl.float32)
                total = acc.to(dw_ptr.dtype.element_ty)
                if C_LOAD == "tma":
                    dw_desc.store([e * D + td * BLOCK_D, to * BLOCK_O], total)
                elif EVEN:
                    tl.store(tile, total)
                else:
                    tl.store(tile, total, mask=inside)

    return wgrad_accumulate


def grouped_wgrad_accumulate_(
    dw_EDO: torch.Tensor,
    x_RD: torch.Tensor,
    dy_RO: torch.Tensor,
    offs_E: torch.Tensor,
    tile: WgradTile | None = None,
) -> None:
    """``dw_EDO[e] += x_e^T @ dy_e`` for every expert; ``offs_E`` inclusive row ends (device)."""
    E, D, O = dw_EDO.shape
    if x_RD.shape[0] == 0 or E == 0:
        return
    if not dw_EDO.is_contiguous():
        raise ValueError(f"grouped_wgrad_accumulate_ adds into a contiguous gradient; got strides {dw_EDO.stride()}.")
    x_RD = x_RD.contiguous()
    dy_RO = dy_RO.contiguous()
    offs = offs_E.to(torch.int32).contiguous()
    if _interpreting() and not x_RD.is_cuda:  # the interpreter: small blocks, quick on CPU
        asked = tile if tile is not None else WgradTile()
        tile = WgradTile(32, 32, 16, 4, 1, asked.c_load, asked.programs_per_sm)
    elif tile is None:
        tile = tile_for(x_RD.dtype)
    if tile.c_load not in _C_LOADS:
        raise ValueError(f"WgradTile.c_load={tile.c_load!r} is not one of {_C_LOADS}.")
    even = D % tile.block_d == 0 and O % tile.block_o == 0
    dw_desc = None
    if tile.c_load == "tma":
        if D % tile.block_d or (O * dw_EDO.element_size()) % 16:
            tile = tile._replace(c_load="early")  # a tile would cross into the next expert's rows
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor

            dw_desc = TensorDescriptor.from_tensor(dw_EDO.view(E * D, O), [tile.block_d, tile.block_o])
    tiles = E * -(-D // tile.block_d) * -(-O // tile.block_o)
    if tile.programs_per_sm:
        tiles = min(tiles, tile.programs_per_sm * _sm_count(x_RD.device))
    _kernel()[(tiles,)](
        x_RD, dy_RO, dw_EDO, dw_desc, offs, E, D, O, x_RD.stride(0), dy_RO.stride(0),
        BLOCK_D=tile.block_d, BLOCK_O=tile.block_o, BLOCK_R=tile.block_r,
        C_LOAD=tile.c_load, EVEN=even, IEEE=x_RD.dtype == torch.float32,
        num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
