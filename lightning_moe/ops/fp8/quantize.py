"""Quantize tensors to FP8 in scaling units, and back.

Legend: M rows, K the contracted width (``reduce_dim``), N output width, E experts, R rows sorted by
expert, G0/G1 the unit grid over the last two dims, T row tiles of a grouped-rows tensor.

Units, the scale convention and the non-finite rule are those of ``recipe.py``: each unit gets one
fp32 dequantization scale ``amax / FP8_MAX[fmt]`` (an IEEE division, correctly rounded; 1 for a
unit of zeros; optionally rounded up to a power of two), ``data = clamp(x / scale, +-FP8_MAX)`` cast to the format (round to nearest even),
and ``x ~= data.float() * scale``. A unit holding NaN or +-inf gets a NaN scale and NaN data.
Scales are floored at the smallest normal fp32 (``torch.finfo(torch.float32).tiny``), so a unit
whose amax is below ``FP8_MAX * tiny`` keeps only what that scale can represent (values that small
are zero for any training purpose).

Everything runs on the tensor's device with no host sync and no Python loop over units: the last
two dims are viewed as ``[..., G0, t0, G1, t1]`` and reduced. Where the units tile them exactly
this is two passes over the source in its own dtype (the units' inf-norms, then one division stored
as FP8; dequantization: widen, multiply); otherwise they are padded with zeros to the unit grid in
fp32 and the padding is sliced off again (the data itself keeps its shape). Both give the same
bits on CPU and for fp32/fp16 sources on CUDA (tests/unit/test_fp8_fast_path.py,
tests/gpu/test_fp8_fast_quantize_gpu.py); bf16 sources on CUDA take the padded path
(``_two_pass_exact_for``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_moe.ops.fp8.recipe import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Format,
    Fp8Recipe,
    check_format,
    check_recipe,
    default_tile,
)

__all__ = ["Fp8Tensor", "fake_quantize", "gather_fp8_rows", "grouped_row_units", "quantize", "quantize_grouped_rows"]

_TINY = torch.finfo(torch.float32).tiny
_NO_FP8_STORE: set[str] = set()  # device types whose torch refused ``torch.div(..., out=<fp8>)``


@dataclass(frozen=True, eq=False)
class Fp8Tensor:
    """FP8 values with their fp32 dequantization scales (a plain carrier, not a tensor subclass).

    ``data``: float8 values, the source's shape. ``scale``: one fp32 per unit, laid out as the unit
    grid over the last two dims with leading batch dims kept: tensorwise ``[..., 1, 1]``, rowwise
    ``[..., M, 1]`` (reduce_dim=-1) or ``[..., 1, N]`` (reduce_dim=-2), blockwise
    ``[..., ceil(M/t0), ceil(K/t1)]`` with ``(t0, t1)`` the tile in dim order. ``reduce_dim`` is -1
    or -2; ``tile`` is set for blockwise only, as ``(extent along the other dim, extent along
    reduce_dim)``.

    ``offs`` is set only for a grouped-rows tensor (``quantize_grouped_rows``): units then run along
    the rows of each expert segment and the scale layout is the one described there.
    """

    data: torch.Tensor
    scale: torch.Tensor
    recipe: Fp8Recipe
    fmt: Fp8Format
    reduce_dim: int
    tile: tuple[int, int] | None
    offs: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def grouped(self) -> bool:
        """Whether this is a grouped-rows tensor (units inside expert segments of the rows)."""
        return self.offs is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data.float() * scale`` per unit, in ``dtype``."""
        if self.offs is not None:
            return _dequantize_grouped(self).to(dtype)
        dim_tile = _dim_tile(self.recipe, self.reduce_dim, self.tile)
        if _divides_grid(self.data.shape, dim_tile):
            return _dequantize_exact_grid(self.data, self.scale, dim_tile, dtype)
        return _per_unit(self.data.float(), self.scale, dim_tile, "mul").to(dtype).contiguous()

    def index_rows(self, idx: torch.Tensor) -> Fp8Tensor:
        """The rows ``idx`` (dim 0) with their scales; for 2-D tensors with reduce_dim=-1 whose rows carry
        their own scales (rowwise, blockwise with one-row tiles) or share one (tensorwise)."""
        row_units = self.recipe == "rowwise" or (self.recipe == "blockwise" and self.tile is not None and self.tile[0] == 1)
        if self.data.dim() != 2 or self.reduce_dim != -1 or self.offs is not None:
            raise ValueError(
                "index_rows needs a 2-D Fp8Tensor quantized along its last dim (reduce_dim=-1), not grouped rows; "
                f"got shape {tuple(self.shape)}, reduce_dim={self.reduce_dim}, grouped={self.grouped}"
            )
        if self.recipe == "tensorwise":
            return Fp8Tensor(gather_fp8_rows(self.data, idx), self.scale, self.recipe, self.fmt, self.reduce_dim, self.tile)
        if not row_units:
            raise ValueError(f"index_rows needs units of one row; tile {self.tile} spans {self.tile[0]} rows")
        return Fp8Tensor(gather_fp8_rows(self.data, idx), self.scale[idx], self.recipe, self.fmt, self.reduce_dim, self.tile)

    def transpose(self) -> Fp8Tensor:
        """The same units with the last two dims swapped (a view of data and scale): ``reduce_dim``
        flips with them, the tile is unchanged (it is written relative to ``reduce_dim``).

        A GEMM may contract the result over its dim -2 when the units allow it: tensorwise, or square
        blockwise tiles (``(128, 128)`` weights serve the forward and the data-gradient GEMM alike)."""
        if self.offs is not None:
            raise ValueError("a grouped-rows Fp8Tensor cannot be transposed (its units follow the row segments)")
        return Fp8Tensor(
            self.data.transpose(-1, -2),
            self.scale.transpose(-1, -2),
            self.recipe,
            self.fmt,
            -1 if self.reduce_dim == -2 else -2,
            self.tile,
        )


def gather_fp8_rows(data_SK: torch.Tensor, idx_R: torch.Tensor) -> torch.Tensor:
    """``data_SK[idx_R]`` for FP8 rows, moved as 8-byte words where the rows allow (a gather of
    one-byte elements moves a byte per index step)."""
    K = data_SK.shape[1]
    if K % 8 == 0 and K > 0 and data_SK.is_contiguous() and data_SK.data_ptr() % 8 == 0:
        words = data_SK.view(torch.uint8).view(torch.int64)
        return words.index_select(0, idx_R.to(device=data_SK.device, dtype=torch.long)).view(torch.uint8).view(data_SK.dtype)
    return data_SK[idx_R]


# ---- units of a dense tensor ---------------------------------------------------------------------


def _dim_tile(recipe: str, reduce_dim: int, tile: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """Unit extents in dim order (dim -2, dim -1); ``None`` spans the whole dim."""
    if recipe == "tensorwise":
        return (None, None)
    if recipe == "rowwise":
        return (1, None) if reduce_dim == -1 else (None, 1)
    assert tile is not None  # set by quantize for blockwise
    return (tile[0], tile[1]) if reduce_dim == -1 else (tile[1], tile[0])


def _grid(size: int, t: int | None) -> tuple[int, int]:
    """(units, extent of one unit) along a dim of ``size`` (a whole-dim unit of an empty dim is one unit of 1)."""
    if t is None:
        return 1, max(size, 1)
    return -(-size // t), t


def _blocks(x: torch.Tensor, dim_tile: tuple[int | None, int | None]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` zero-padded to the unit grid and viewed as ``[..., G0, t0, G1, t1]``."""
    M, K = x.shape[-2:]
    g0, t0 = _grid(M, dim_tile[0])
    g1, t1 = _grid(K, dim_tile[1])
    if g0 * t0 != M or g1 * t1 != K:
        x = F.pad(x, (0, g1 * t1 - K, 0, g0 * t0 - M))
    return x.reshape(*x.shape[:-2], g0, t0, g1, t1), (M, K)


def _per_unit(x: torch.Tensor, scale: torch.Tensor, dim_tile, op: str) -> torch.Tensor:
    """``x / scale`` or ``x * scale`` with each unit's scale (``x`` fp32, same shape out)."""
    blocks, (M, K) = _blocks(x, dim_tile)
    s = scale.unsqueeze(-1).unsqueeze(-3)  # [..., G0, 1, G1, 1]
    out = blocks / s if op == "div" else blocks * s
    out = out.reshape(*out.shape[:-4], out.shape[-4] * out.shape[-3], out.shape[-2] * out.shape[-1])
    return out[..., :M, :K]


def scales_from_amax(amax: torch.Tensor, fmt: str, pow2_scales: bool) -> torch.Tensor:
    """Dequantization scales for units of absolute maximum ``amax`` (fp32, device-side)."""
    # a true division (CUDA turns a division by a Python number into a multiplication by its
    # reciprocal, which differs in the last bit): the scale is amax / FP8_MAX correctly rounded
    s = (amax / torch.full_like(amax, FP8_MAX[fmt])).clamp_min(_TINY)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    if pow2_scales:
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
        s = torch.where(mantissa == 0.5, s, torch.ldexp(torch.ones_like(s), exponent))
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def _to_fp8(x32: torch.Tensor, fmt: str) -> torch.Tensor:
    m = FP8_MAX[fmt]
    # clamp keeps NaN (e4m3fn has no inf to overflow to); every NaN is made the same positive quiet
    # NaN first, since a NaN's sign and payload after a division differ between the CPU and CUDA
    x32 = torch.where(torch.isnan(x32), torch.full_like(x32, float("nan")), x32.clamp(-m, m))
    return x32.to(FP8_DTYPE[fmt])


def _check_source(x: object, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in FP8_DTYPE.values():
        raise TypeError(f"{what} must be a floating-point (fp32/bf16/fp16) tensor to quantize, got {x.dtype}")
    return x


def _normalise_reduce_dim(reduce_dim: object, ndim: int) -> int:
    if isinstance(reduce_dim, bool) or not isinstance(reduce_dim, int):
        raise TypeError(f"reduce_dim must be an int (-1 or -2), got {reduce_dim!r}")
    rd = reduce_dim - ndim if reduce_dim >= 0 else reduce_dim
    if rd not in (-1, -2):
        raise ValueError(
            f"reduce_dim={reduce_dim} for a {ndim}-D tensor: the contracted dim must be one of the last two (-1 or -2)"
        )
    return rd


def _check_tile(recipe: str, tile: object, reduce_dim: int) -> tuple[int, int] | None:
    if recipe != "blockwise":
        if tile is not None:
            raise ValueError(f"tile={tile!r} applies to the blockwise recipe only, not {recipe!r}; leave tile=None")
        return None
    if tile is None:
        return default_tile(reduce_dim)
    if (
        not isinstance(tile, tuple)
        or len(tile) != 2
        or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tile)
    ):
        raise ValueError(f"tile must be a pair of positive ints (other dim, reduce_dim), e.g. (1, {BLOCK}); got {tile!r}")
    return tile


def quantize(
    x: torch.Tensor,
    recipe: Fp8Recipe,
    fmt: Fp8Format = "e4m3",
    *,
    reduce_dim: int = -1,
    tile: tuple[int, int] | None = None,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """Quantize ``x`` (2-D or more; leading dims are batch dims, e.g. experts) in the units of ``recipe``.

    ``reduce_dim``: the dim the consuming GEMM contracts over (-1 for ``x_MK``, -2 for ``w_KN`` or
    ``w_EKN``). ``tile``: blockwise only, ``(extent along the other dim, extent along reduce_dim)``;
    default ``(1, 128)`` for reduce_dim=-1 and ``(128, 128)`` for reduce_dim=-2.

    Layout: the data is contiguous along ``reduce_dim`` (reduce_dim=-2: a column-major view, as
    FP8 GEMMs take their second operand); the scale grid is laid out the same way."""
    recipe = check_recipe(recipe)
    fmt = check_format(fmt)
    x = _check_source(x, "x")
    if x.dim() < 2:
        raise ValueError(f"quantize needs a tensor of 2 or more dims, got shape {tuple(x.shape)}")
    rd = _normalise_reduce_dim(reduce_dim, x.dim())
    tl = _check_tile(recipe, tile, rd)
    if rd == -2:
        # quantized in the transposed frame: the data comes out column-major (contracted dim
        # contiguous), the layout FP8 GEMMs take for b, with no transposing copy of the FP8 bytes;
        # a source that is itself a transposed view (w.transpose(-1, -2)) is read in place
        return _quantize_last(x.transpose(-1, -2), recipe, fmt, tl, pow2_scales).transpose()
    return _quantize_last(x, recipe, fmt, tl, pow2_scales)


def _divides_grid(shape: torch.Size, dim_tile: tuple[int | None, int | None]) -> bool:
    """Whether the units tile the last two dims exactly (no padding) and there is data."""
    M, K = shape[-2:]
    if M == 0 or K == 0:
        return False
    return all(t is None or size % t == 0 for size, t in zip((M, K), dim_tile))


def _two_pass_exact_for(x: torch.Tensor) -> bool:
    """Whether the two-pass quantization gives the padded path's bytes for ``x``'s dtype.

    On an H200 (torch 2.11) its result differed from the padded fp32 path and from the CPU for
    bf16 sources (fp32 and fp16 sources were bitwise equal on both devices). bf16 sources take the
    padded fp32 ops on every device, so the CPU and CUDA quantize a bf16 tensor to the same bytes;
    on CUDA its activations are quantized by the csrc kernels (``kernels.py``) anyway."""
    return x.dtype != torch.bfloat16


def _quantize_exact_grid(x: torch.Tensor, dim_tile, fmt: str, pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Data and scales of ``x`` whose units tile it exactly, in two passes over ``x`` in its own dtype.

    The same numbers as the padded path: the amax is exact in any float dtype (the inf-norm of each
    unit, one read; NaN propagates), and ``x / scale`` is divided in fp32 and rounded once to
    the format on store. The clamp is not needed: with ``scale >= amax / FP8_MAX`` (correctly
    rounded), ``|x / scale| <= FP8_MAX * (1 + 2**-23)``, which rounds to ``FP8_MAX``."""
    blocks, _ = _blocks(x.detach(), dim_tile)  # a view: splitting dims never copies
    dims = (-3, -1)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=dims).float()
    scale = scales_from_amax(amax, fmt, pow2_scales)
    data = torch.empty(x.shape, dtype=FP8_DTYPE[fmt], device=x.device)
    torch.div(blocks, scale.unsqueeze(-1).unsqueeze(-3), out=data.view(blocks.shape))
    return data, scale


def _dequantize_exact_grid(data: torch.Tensor, scale: torch.Tensor, dim_tile, dtype: torch.dtype) -> torch.Tensor:
    """``data.float() * scale`` rounded to ``dtype``, for units that tile ``data`` exactly: the FP8
    values widened to bf16 (exact: both formats fit) and multiplied in fp32 on store, two passes."""
    wide, _ = _blocks(data.to(torch.bfloat16), dim_tile)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    torch.mul(wide, scale.unsqueeze(-1).unsqueeze(-3), out=out.view(wide.shape))
    return out


def _quantize_last(x: torch.Tensor, recipe: str, fmt: str, tile, pow2_scales: bool) -> Fp8Tensor:
    """``quantize`` with reduce_dim=-1 (the data row-major)."""
    dim_tile = _dim_tile(recipe, -1, tile)
    if _divides_grid(x.shape, dim_tile) and x.device.type not in _NO_FP8_STORE and _two_pass_exact_for(x):
        try:
            data, scale = _quantize_exact_grid(x, dim_tile, fmt, pow2_scales)
        except (RuntimeError, TypeError) as err:  # this torch cannot store an FP8 result of a division
            _NO_FP8_STORE.add(x.device.type)
            warnings.warn(f"quantize: the two-pass path is unavailable here ({err}); quantizing with padded fp32 ops", stacklevel=3)
        else:
            return Fp8Tensor(data, scale, recipe, fmt, -1, tile)  # type: ignore[arg-type]
    blocks, (M, K) = _blocks(x.float(), dim_tile)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., G0, G1]; NaN propagates
    scale = scales_from_amax(amax, fmt, pow2_scales)
    q = _to_fp8(blocks / scale.unsqueeze(-1).unsqueeze(-3), fmt)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * q.shape[-3], q.shape[-2] * q.shape[-1])[..., :M, :K]
    return Fp8Tensor(q.contiguous(), scale, recipe, fmt, -1, tile)  # type: ignore[arg-type]


def fake_quantize(
    x: torch.Tensor,
    recipe: Fp8Recipe,
    fmt: Fp8Format = "e4m3",
    *,
    reduce_dim: int = -1,
    tile: tuple[int, int] | None = None,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """``quantize`` then ``dequantize``, in ``x``'s dtype (the values an FP8 GEMM sees)."""
    q = quantize(x, recipe, fmt, reduce_dim=reduce_dim, tile=tile, pow2_scales=pow2_scales)
    return q.dequantize(x.dtype)


# ---- grouped rows (weight-gradient operands) -----------------------------------------------------


def _check_offs(offs_E: object, R: int, device: torch.device) -> torch.Tensor:
    if not isinstance(offs_E, torch.Tensor) or offs_E.dim() != 1 or offs_E.is_floating_point():
        raise TypeError(f"offs_E must be a 1-D integer tensor (inclusive row offsets per expert), got {offs_E!r}")
    if offs_E.numel() == 0:
        raise ValueError("offs_E must name at least one expert")
    return offs_E.to(device=device, dtype=torch.int32)


def grouped_row_units(offs_E: torch.Tensor, R: int, recipe: str) -> tuple[torch.Tensor, int]:
    """Per row its unit index along the rows, and the number of units U (device-side).

    tensorwise/rowwise: the row's expert (U = E); blockwise: its 128-row tile, numbered so that
    expert e's tiles start right after expert e-1's (U = ceil(R/128) + E, an upper bound; unused
    tiles keep scale 1). Rows past ``offs_E[-1]`` get index U (no unit)."""
    E = offs_E.shape[0]
    r_R = torch.arange(R, device=offs_E.device, dtype=torch.int32)
    e_R = torch.searchsorted(offs_E, r_R, right=True)  # [R] in [0, E]; E: past the last expert
    if recipe != "blockwise":
        return e_R, E
    zero = offs_E.new_zeros(1)
    start_E = torch.cat([zero, offs_E[:-1]])
    tiles_E = torch.div(offs_E - start_E + (BLOCK - 1), BLOCK, rounding_mode="floor")
    U = -(-R // BLOCK) + E
    tile_start_E1 = torch.cat([zero, torch.cumsum(tiles_E, 0, dtype=torch.int32)])  # [E + 1]
    start_E1 = torch.cat([start_E, offs_E[-1:]])
    unit_R = tile_start_E1[e_R] + torch.div(r_R - start_E1[e_R], BLOCK, rounding_mode="floor")
    unit_R = torch.where(e_R == E, torch.full_like(unit_R, U), unit_R)
    return unit_R, U


def quantize_grouped_rows(
    x_RK: torch.Tensor,
    offs_E: torch.Tensor,
    recipe: Fp8Recipe,
    fmt: Fp8Format = "e4m3",
    *,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """Quantize rows sorted by expert for a GEMM that contracts over the rows of each expert segment
    (the weight gradient ``x_e^T @ dy_e``): units run along R and never cross an expert boundary.

    ``offs_E``: inclusive cumulative row counts (int32, as ``F.grouped_mm`` takes); empty experts are
    fine. Scale layout (``reduce_dim`` is -2, ``offs`` is kept on the result):

    * tensorwise: ``[E, 1]``, one per expert;
    * rowwise: ``[E, K]``, one per (expert, column);
    * blockwise: ``[ceil(R/128) + E, K]``, one per (128-row tile, column); tiles start at each
      expert's first row (its last tile may be partial), expert e's tiles follow expert e-1's, and
      the unused tail of the table holds 1 (``grouped_row_units`` maps rows to tiles). ``tile`` is
      ``(1, 128)``: 1 column by 128 rows.

    Rows past ``offs_E[-1]`` belong to no expert: they quantize to zero."""
    recipe = check_recipe(recipe)
    fmt = check_format(fmt)
    x_RK = _check_source(x_RK, "x_RK")
    if x_RK.dim() != 2:
        raise ValueError(f"quantize_grouped_rows needs rows [R, K], got shape {tuple(x_RK.shape)}")
    R, K = x_RK.shape
    offs = _check_offs(offs_E, R, x_RK.device)
    unit_R, U = grouped_row_units(offs, R, recipe)
    x32 = x_RK.float()
    idx_RK = unit_R[:, None].long().expand(R, K)
    amax_UK = x32.new_zeros(U + 1, K).scatter_reduce_(0, idx_RK, x32.abs(), "amax", include_self=True)
    bad_UK = x32.new_zeros(U + 1, K).scatter_reduce_(
        0, idx_RK, (~torch.isfinite(x32)).float(), "amax", include_self=True
    )
    amax_UK = torch.where(bad_UK > 0, torch.full_like(amax_UK, float("nan")), amax_UK)[:U]
    if recipe == "tensorwise":
        if K == 0:
            amax_UK = amax_UK.new_zeros(U, 1)
        else:
            amax_UK = amax_UK.amax(dim=1, keepdim=True)
    scale_U = scales_from_amax(amax_UK, fmt, pow2_scales)
    s_RK = torch.cat([scale_U, scale_U.new_ones(1, scale_U.shape[1])])[unit_R.long()]
    q = _to_fp8(x32 / s_RK, fmt)
    q = torch.where((unit_R == U)[:, None], torch.zeros((), dtype=q.dtype, device=q.device), q)
    tile = (1, BLOCK) if recipe == "blockwise" else None
    return Fp8Tensor(q, scale_U, recipe, fmt, -2, tile, offs)


def _dequantize_grouped(t: Fp8Tensor) -> torch.Tensor:
    assert t.offs is not None
    R = t.data.shape[0]
    unit_R, U = grouped_row_units(t.offs, R, t.recipe)
    s = torch.cat([t.scale, t.scale.new_zeros(1, t.scale.shape[1])])[unit_R.long()]
    out = t.data.float() * s
    return torch.where((unit_R == U)[:, None], torch.zeros((), device=out.device), out)
