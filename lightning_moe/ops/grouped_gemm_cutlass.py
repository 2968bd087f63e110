"""The experts' forward and data-gradient GEMMs as one CUTLASS grouped GEMM (Hopper).

Legend: R rows grouped by expert, K the rows' width (the GEMM's reduction), N the output width,
E experts.

``out_RN[lo:hi] = a_RK[lo:hi] @ w_EKN[e]`` for every expert in one warp-specialised launch that
reads each expert's row range from the device offsets (no host sync): the contract of
``F.grouped_mm(a, w, offs=offs)`` for a 2-d ``a`` and a 3-d ``w``. ``w_EKN`` may be N-major (each
``w[e]`` N-contiguous: the layer's forward reads ``w13`` and ``w2`` so) or K-major (each ``w[e]``
K-contiguous, i.e. ``w.transpose(1, 2)`` of a contiguous tensor: its data gradient reads them so).
Source: ``csrc/cutlass/grouped_gemm*``; build: ``ops/build_cutlass.py`` (optional: needs the
CUTLASS headers and an sm_90 GPU).

Where the layer uses it (:func:`layer_tiling`, read by ``ops/grouped_gemm.py`` for every forward
and data-gradient GEMM of the ``torch`` backend), by ``KernelConfig.gemm`` (chosen when the layer is
built, passed down as a plain string): ``auto`` (default: CUTLASS ping-pong 64 x 256 for wide
experts with few rows each, ``F.grouped_mm`` otherwise), ``torch`` (always ``F.grouped_mm``) or
``cutlass`` (CUTLASS wherever it applies, at ``KernelConfig.gemm_cutlass_tile``). Raced on the H200
(``benchmarks/probes/expert_gemms.py``, the four GEMMs of a layer, each in the layout the layer reads):
DeepSeek-V3 (expert matrices of 29-59 MB, ~512 rows an expert) ping-pong 64 x 256 22.8 ms vs 26.8
for ``F.grouped_mm`` (-15 % on three of the four GEMMs, -6 % on the fourth); Qwen3-30B-A3B (3-6 MB,
~1024 rows) and Mixtral-8x7B (117-235 MB, ~4096 rows) ``F.grouped_mm`` ahead or level on all four
(Qwen3 up 1.28 vs 1.41 ms for the best CUTLASS tiling; Mixtral 41.1 vs 44.2 ms for ping-pong
64 x 256). Hence "wide": expert matrices of at least 16 MB *and* at most 768 rows an expert on
average (with few rows an expert, a 128-row tile's partly filled last tile is a larger share of the
work; 64-row tiles halve that waste).

The tilings built (``csrc/cutlass/grouped_gemm.h``): ``cooperative-128x256-c2x1`` (the default of
``cutlass``: 128 x 256 tiles, both consumer warp groups on one tile, clusters of two along M sharing
the ``w`` tile through TMA multicast; the tiling torch's ``grouped_mm`` uses on sm_90, though it ran
slower in this build than in torch on Qwen3: 1.46 vs 1.28 ms) and ``pingpong-64x256`` (each
consumer warp group owns a 64 x 256 tile, one's epilogue overlapping the other's MMAs; what ``auto``
runs).
"""

from __future__ import annotations

from typing import get_args

import torch

from lightning_moe.config import GemmKernel
from lightning_moe.ops.build_cutlass import load_cutlass_extension

__all__ = ["DEFAULT_TILE", "GEMM_KERNELS", "TILES", "WIDE_TILE", "grouped_mm", "layer_tiling", "supported"]

TILES = {"cooperative-128x256-c2x1": 0, "pingpong-64x256": 1}
DEFAULT_TILE = "cooperative-128x256-c2x1"
GEMM_KERNELS = get_args(GemmKernel)
WIDE_TILE = "pingpong-64x256"
# Where ping-pong 64 x 256 beat F.grouped_mm (module docstring): expert matrices (K x N) of at
# least this many bytes (between Qwen3-30B-A3B's 6.3 MB and DeepSeek-V3's 29 MB) ...
_WIDE_BYTES = 16 * 2**20
# ... and at most this many rows an expert on average (DeepSeek-V3 512; Mixtral-8x7B 4096 lost).
_MAX_ROWS_PER_EXPERT = 768


def layer_tiling(
    a_RK: torch.Tensor, w_EKN: torch.Tensor, kernel: str = "auto", tile: str = DEFAULT_TILE
) -> str | None:
    """The CUTLASS tiling the layer's grouped GEMM ``a @ w[e]`` should run, or ``None`` for ``F.grouped_mm``.

    ``kernel`` is one of :data:`GEMM_KERNELS`; ``tile`` (a key of :data:`TILES`) is what ``cutlass`` runs.
    """
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"layer_tiling: kernel={kernel!r} is not one of {GEMM_KERNELS}; choose one of them.")
    if kernel == "torch" or not a_RK.is_cuda:
        return None
    if kernel == "auto" and not _pingpong_pays(a_RK.shape[0], w_EKN):
        return None
    if not supported(a_RK, w_EKN):
        return None
    return WIDE_TILE if kernel == "auto" else tile


def _pingpong_pays(rows: int, w_EKN: torch.Tensor) -> bool:
    E, K, N = w_EKN.shape
    return K * N * w_EKN.element_size() >= _WIDE_BYTES and rows <= _MAX_ROWS_PER_EXPERT * E


def _w_layout_ok(w_EKN: torch.Tensor) -> bool:
    """N-major or K-major matrices, ``K * N`` elements apart (as the kernel reads them)."""
    E, K, N = w_EKN.shape
    s0, s1, s2 = w_EKN.stride()
    packed = E <= 1 or s0 == K * N
    return packed and ((s2 == 1 and s1 == N) or (s1 == 1 and s2 == K))


def supported(a_RK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """Whether the CUTLASS kernel can multiply these (cheap checks first; the build last)."""
    if not a_RK.is_cuda or a_RK.dtype != torch.bfloat16 or w_EKN.dtype != torch.bfloat16:
        return False
    if a_RK.dim() != 2 or w_EKN.dim() != 3 or a_RK.shape[1] != w_EKN.shape[1]:
        return False
    K, N = w_EKN.shape[1:]
    if K == 0 or N == 0 or K % 8 or N % 8 or not _w_layout_ok(w_EKN):
        return False
    return load_cutlass_extension() is not None


def grouped_mm(
    a_RK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, tiling: str | None = None
) -> torch.Tensor:
    """``out_RN[lo:hi] = a_RK[lo:hi] @ w_EKN[e]`` per expert; ``offs_E`` inclusive row ends (int32, device).

    No autograd. Rows from ``offs_E[-1]`` on are left uninitialised, as ``F.grouped_mm`` leaves
    them. ``tiling`` is a key of :data:`TILES` (default: :data:`DEFAULT_TILE`). Bad input (dtype, layout,
    alignment, shapes) raises ``RuntimeError`` from the op, naming the value and the fix.
    """
    ops = load_cutlass_extension()
    if ops is None:
        raise RuntimeError(
            "grouped_mm: the CUTLASS kernels are unavailable; check grouped_gemm_cutlass.supported() first."
        )
    name = tiling or DEFAULT_TILE
    if name not in TILES:
        raise RuntimeError(f"grouped_mm: tiling={name!r} is unknown; choose one of {tuple(TILES)}.")
    return ops.grouped_mm(a_RK, w_EKN, offs_E, TILES[name])
