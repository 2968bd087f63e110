"""FP8 scaling recipes: which elements share one scale, and the formats.

Legend: M rows of an activation, K the contracted width, N output width, E experts, R rows sorted
by expert.

An operand of a GEMM is quantized in *units*, each with one fp32 scale. Units are described by
the dim the GEMM contracts over, ``reduce_dim`` (-1 for activations ``x_MK``, -2 for weights
``w_KN``), so that every unit's scale is constant along a slice of the contraction:

* ``tensorwise``: one scale for the whole tensor (per expert for a 3-D weight ``w_EKN``).
* ``rowwise``: one scale per 1-D slice along ``reduce_dim`` (``x_MK`` -> scale ``[M, 1]``,
  ``w_KN`` -> ``[1, N]``, ``w_EKN`` -> ``[E, 1, N]``).
* ``blockwise`` (the DeepSeek-V3 recipe): tiles of ``(1, 128)`` for activations and gradients,
  ``(128, 128)`` for weights. A tile is written ``(extent along the other dim, extent along
  reduce_dim)``; sizes that are not a multiple of the tile leave a partial last tile, which is a
  unit of its own (the data is never padded). The scale is the tile grid in the tensor's own dim
  order, e.g. ``[M, ceil(K/128)]`` for ``(1, 128)`` on ``x_MK``.

Scale convention: scales are fp32 *dequantization* scales, ``x ~= data.float() * scale`` (broadcast
per unit), computed on the device from the unit's absolute maximum with no host sync:
``scale = amax / FP8_MAX[fmt]``, optionally rounded up to a power of two (``pow2_scales=True``: the
division by the scale is then exact). A unit of zeros gets scale 1.

Non-finite rule: a unit holding NaN or +-inf gets a NaN scale and NaN data, so it dequantizes to
NaN throughout and every GEMM output it touches is NaN (the non-finite guard sees it; nothing is
clamped away). Other units are unaffected.
"""

from __future__ import annotations

from typing import get_args

import torch

from lightning_moe.config import Fp8Format, Fp8Recipe

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Format",
    "Fp8Recipe",
    "check_format",
    "check_recipe",
    "default_tile",
]

FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128

ACTIVATION_TILE = (1, BLOCK)
WEIGHT_TILE = (BLOCK, BLOCK)


def check_recipe(recipe: object) -> Fp8Recipe:
    """``recipe`` itself, or a ValueError naming the choices."""
    if recipe not in get_args(Fp8Recipe):
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {get_args(Fp8Recipe)}")
    return recipe  # type: ignore[return-value]


def check_format(fmt: object) -> Fp8Format:
    """``fmt`` itself, or a ValueError naming the choices."""
    if fmt not in get_args(Fp8Format):
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {get_args(Fp8Format)}")
    return fmt  # type: ignore[return-value]


def default_tile(reduce_dim: int) -> tuple[int, int]:
    """The blockwise tile when none is given: ``(1, 128)`` for operands contracted over their last
    dim (activations, gradients), ``(128, 128)`` for those contracted over dim -2 (weights)."""
    return ACTIVATION_TILE if reduce_dim == -1 else WEIGHT_TILE
