"""Grouped weight-gradient GEMM adding into ``.grad``: persistent, descriptor-based, warp-specialisable.

Legend: R rows grouped by expert, D input width, O output width, E experts.

    dw_EDO[e] += x_RD[rows of e]^T @ dy_RO[rows of e]        (fp32 accumulation, one rounding)

The sibling of ``ops/wgrad_triton.py`` built for the one thing that kernel lacks: overlap of one
output tile's gradient read/write with the next tile's MMAs. A persistent grid walks the tiles
(experts outermost); every operand moves through tensor-memory-accelerator descriptors — the
gradient through one descriptor over ``[E*D, O]``, each expert's rows through descriptors made in
the kernel over exactly that expert's row range, so rows past it read as zeros without masks.
Descriptor loops are what Triton's Hopper warp specialisation accepts
(``tl.range(..., warp_specialize=True)``: one warp group loads, the others compute and store).

Experimental: measured only by ``benchmarks/wgrad_kernels.py`` (``--tiles desc``); the layer does
not call it. On the H200 (Triton 3.6, DeepSeek-V3 w13 / w2) its best arm — 128x256x32, 8 warps,
4 stages, warp-specialised — took 16.3 / 8.4 ms against 15.1 / 8.8 ms for the one-stream cuBLAS
loop and 13.2 / 7.2 ms for two streams: warp specialisation helps it (24.5 -> 16.3 ms over the
plain persistent loop) but the gradient still moves at ~1.8 TB/s, so it stays out of the layer. Needs D divisible by ``block_d`` and 16-byte aligned row strides (bf16/fp16: D and O
multiples of 8). ``TRITON_INTERPRET=1`` runs it on CPU tensors for the correctness test.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from lightning_moe.ops.wgrad_triton import _sm_count

__all__ = ["DescTile", "grouped_wgrad_accumulate_desc_"]


class DescTile(NamedTuple):
    """One launch configuration of the descriptor kernel."""

    block_d: int = 128
    block_o: int = 128
    block_r: int = 64
    warps: int = 4
    stages: int = 3
    warp_specialize: bool = False
    flatten: bool = False
    programs_per_sm: int = 1

    def label(self) -> str:
        ws = " ws" if self.warp_specialize else ""
        flat = " flat" if self.flatten else ""
        return (
            f"desc {self.block_d}x{self.block_o}x{self.block_r} w{self.warps} s{self.stages}"
            f" p{self.programs_per_sm}{ws}{flat}"
        )


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def wgrad_accumulate_desc(
        x_ptr, dy_ptr, dw_ptr, offs_ptr, E, D, O, stride_x, stride_dy, PROGRAMS,
        BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
        WS: tl.constexpr, FLATTEN: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[E * D, O], strides=[O, 1], block_shape=[BLOCK_D, BLOCK_O])
        tiles_o = tl.cdiv(O, BLOCK_O)
        per_expert = tl.cdiv(D, BLOCK_D) * tiles_o
        for t in tl.range(tl.program_id(0), E * per_expert, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
            e = t // per_expert
            td = (t % per_expert) // tiles_o
            to = t % tiles_o
            end = tl.load(offs_ptr + e).to(tl.int64)
            start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
            rows = (end - start).to(tl.int32)
            # Descriptors over this expert's rows only: rows past them load as zeros. An empty
            # expert runs no reduction step and writes its old tile back unchanged.
            x_desc = tl.make_tensor_descriptor(
                x_ptr + start * stride_x, shape=[tl.maximum(rows, 1), D], strides=[stride_x, 1],
                block_shape=[BLOCK_R, BLOCK_D],
            )  # fmt: skip
            g_desc = tl.make_tensor_descriptor(
                dy_ptr + start * stride_dy, shape=[tl.maximum(rows, 1), O], strides=[stride_dy, 1],
                block_shape=[BLOCK_R, BLOCK_O],
            )  # fmt: skip
            acc = dw_desc.load([e * D + td * BLOCK_D, to * BLOCK_O]).to(tl.float32)
            for r0 in range(0, rows, BLOCK_R):
                x = x_desc.load([r0, td * BLOCK_D])
                g = g_desc.load([r0, to * BLOCK_O])
                if IEEE:
                    acc = tl.dot(tl.trans(x), g, acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(x), g, acc)
            dw_desc.store([e * D + td * BLOCK_D, to * BLOCK_O], acc.to(dw_ptr.dtype.element_ty))

    return wgrad_accumulate_desc


def _scratch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    """Global memory where the kernel writes the descriptors it makes (Triton asks for it)."""
    del alignment, stream
    return torch.empty(size, dtype=torch.int8, device="cuda")


def supported_shape(D: int, O: int, dtype: torch.dtype, tile: DescTile) -> str | None:
    """``None`` when the descriptor kernel can run this shape, else why not."""
    size = torch.empty((), dtype=dtype).element_size()
    if D % tile.block_d:
        return f"D={D} is not a multiple of block_d={tile.block_d} (a gradient tile would cross experts)"
    if (D * size) % 16 or (O * size) % 16:
        return f"rows of {D} and {O} {dtype} values are not 16-byte aligned (TMA needs it)"
    return None


def grouped_wgrad_accumulate_desc_(
    dw_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor, tile: DescTile
) -> None:
    """``dw_EDO[e] += x_e^T @ dy_e`` for every expert; ``offs_E`` inclusive row ends (device)."""
    E, D, O = dw_EDO.shape
    reason = supported_shape(D, O, dw_EDO.dtype, tile)
    if reason is not None:
        raise ValueError(f"grouped_wgrad_accumulate_desc_: {reason}.")
    if not dw_EDO.is_contiguous():
        raise ValueError(f"grouped_wgrad_accumulate_desc_ adds into a contiguous gradient; got strides {dw_EDO.stride()}.")
    if x_RD.shape[0] == 0 or E == 0:
        return
    import triton

    x_RD, dy_RO = x_RD.contiguous(), dy_RO.contiguous()
    offs = offs_E.to(torch.int32).contiguous()
    tiles = E * (D // tile.block_d) * -(-O // tile.block_o)
    if x_RD.is_cuda:
        triton.set_allocator(_scratch)
        programs = min(tiles, tile.programs_per_sm * _sm_count(x_RD.device))
    else:  # the interpreter: a couple of programs walk every tile
        programs = min(tiles, 2)
    _kernel()[(programs,)](
        x_RD, dy_RO, dw_EDO, offs, E, D, O, x_RD.stride(0), dy_RO.stride(0), programs,
        BLOCK_D=tile.block_d, BLOCK_O=tile.block_o, BLOCK_R=tile.block_r,
        WS=tile.warp_specialize, FLATTEN=tile.flatten, IEEE=x_RD.dtype == torch.float32, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
