"""Expert weight gradients accumulated into ``.grad`` by one CUTLASS grouped GEMM (Hopper).

Legend: R rows grouped by expert, D input width, O output width, E experts.

``grad_EDO[e] += x_e^T @ dy_e`` for all experts in one warp-specialised launch that reads each
expert's row range from the device offsets (no host sync) and adds the old gradient in its
epilogue (beta = 1): the gradient is read once and written once, with no per-expert launch,
memset or host bound. H200, both weights of one layer: Qwen3-30B-A3B 2.16 ms vs 2.81 for the
grouped GEMM plus autograd's addition (``benchmarks/probes/wgrad_kernels.py --cutlass-only``), so the
fusion uses it for narrow experts. For wide experts it does not win where it counts: timed
inside the DeepSeek-V3 layer step (``benchmarks/probes/wgrad_in_layer.py``) it takes 20.0 ms vs 18.2 for
the two-stream cuBLAS loop (alone, with a synchronised start each time, the loop's 512 launches
are paced by the host and it looked slower: 21.5 vs 18.4).
Source: ``csrc/cutlass/``; build: ``ops/build_cutlass.py`` (optional: needs the CUTLASS headers
and an sm_90 GPU).

One tiling is built (``csrc/cutlass/grouped_wgrad.h``): ``cooperative-c1x2``, 256 x 128 tiles,
both consumer warp groups on one tile, clusters of two along N sharing the ``x_e^T`` tile through
TMA multicast (the fastest of the tilings measured, summed over both weights of every shape).
"""

from __future__ import annotations

from types import ModuleType

import torch

from lightning_moe.ops.build_cutlass import load_cutlass_extension

__all__ = ["DEFAULT_TILE", "TILES", "grouped_wgrad_accumulate_", "reference_accumulate_", "supported"]

TILES = {"cooperative-c1x2": 0}
DEFAULT_TILE = "cooperative-c1x2"


def supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the CUTLASS kernel can accumulate these weights' gradients from rows like ``x``."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if any(w.dtype != torch.bfloat16 or w.dim() != 3 or w.shape[1] % 8 or w.shape[2] % 8 for w in weights):
        return False
    return load_cutlass_extension() is not None


def grouped_wgrad_accumulate_(
    grad_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor, tiling: str | None = None
) -> None:
    """``grad_EDO[e] += x_RD[lo:hi]^T @ dy_RO[lo:hi]`` per expert; ``offs_E`` inclusive row ends (int32, device)."""
    _extension("grouped_wgrad_accumulate_").grouped_wgrad_accumulate_(
        grad_EDO, x_RD.contiguous(), dy_RO.contiguous(), _int32(offs_E), _tile_index(tiling)
    )


def _tile_index(tiling: str | None) -> int:
    name = DEFAULT_TILE if tiling is None else tiling
    if name not in TILES:
        raise ValueError(
            f"grouped_wgrad_accumulate_: tiling={name!r} is not one of {tuple(TILES)}; choose one of them."
        )
    return TILES[name]


def _extension(op: str) -> ModuleType:
    ops = load_cutlass_extension()
    if ops is None:
        raise RuntimeError(f"{op}: the CUTLASS kernels are unavailable; check ops.wgrad.cutlass_kernel.supported() first.")
    return ops


def _int32(offs_E: torch.Tensor) -> torch.Tensor:
    return (offs_E if offs_E.dtype == torch.int32 else offs_E.to(torch.int32)).contiguous()


def reference_accumulate_(grad_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor) -> None:
    """The same in plain PyTorch (fp32 products, one rounding into ``grad_EDO``'s dtype)."""
    bounds = [0] + offs_E.tolist()
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            grad_EDO[e] = (grad_EDO[e].float() + x_RD[lo:hi].float().t() @ dy_RO[lo:hi].float()).to(grad_EDO.dtype)
