"""FP8 quantization against a plain loop reference: every unit's amax, scale, round trip.

Legend: M rows, K contracted width, N output width, E experts, R rows sorted by expert.

``quantize_reference`` walks the units one by one in Python (amax, scale, ``.to(float8)``, back);
the package's vectorised ``quantize`` must give bit-identical scales and dequantized values,
including the NaN pattern of non-finite units. The error bound is checked as a property: per
element ``|deq - x| <= scale * half an ulp of the format at |x / scale|``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.ops.fp8 import FP8_DTYPE, FP8_MAX, fake_quantize, quantize, quantize_grouped_rows
from lightning_moe.ops.fp8.quantize import Fp8Tensor, grouped_row_units

TINY = torch.finfo(torch.float32).tiny
# (mantissa bits, smallest normal exponent) of each format
FORMAT_BITS = {"e4m3": (3, -6), "e5m2": (2, -14)}


# ---- the loop reference --------------------------------------------------------------------------


def _ref_scale(unit: torch.Tensor, fmt: str, pow2: bool) -> float:
    if unit.numel() == 0:
        return 1.0
    if not torch.isfinite(unit).all():
        return float("nan")
    amax = unit.abs().max().item()
    if amax == 0:
        return 1.0
    s = max(float(torch.tensor(amax, dtype=torch.float32) / FP8_MAX[fmt]), TINY)
    s = float(torch.tensor(s, dtype=torch.float32))
    if pow2:
        m, e = math.frexp(s)
        s = s if m == 0.5 else math.ldexp(1.0, e)
    return s


def _ref_unit(unit: torch.Tensor, fmt: str, pow2: bool) -> tuple[float, torch.Tensor]:
    s = _ref_scale(unit, fmt, pow2)
    st = torch.tensor(s, dtype=torch.float32)
    q = (unit.float() / st).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPE[fmt])
    return s, q.float() * st


def _units_2d(M: int, K: int, recipe: str, reduce_dim: int, tile) -> list[tuple[int, int, slice, slice]]:
    """(grid row, grid col, row slice, col slice) of every unit of an [M, K] matrix."""
    if recipe == "tensorwise":
        return [(0, 0, slice(0, M), slice(0, K))]
    if recipe == "rowwise":
        if reduce_dim == -1:
            return [(i, 0, slice(i, i + 1), slice(0, K)) for i in range(M)]
        return [(0, j, slice(0, M), slice(j, j + 1)) for j in range(K)]
    t0, t1 = (tile[0], tile[1]) if reduce_dim == -1 else (tile[1], tile[0])
    out = []
    for gi, i in enumerate(range(0, M, t0)):
        for gj, j in enumerate(range(0, K, t1)):
            out.append((gi, gj, slice(i, min(i + t0, M)), slice(j, min(j + t1, K))))
    return out


def quantize_reference(x, recipe, fmt="e4m3", *, reduce_dim=-1, tile=None, pow2_scales=False):
    """(scale grid, dequantized x) by a loop over the units of each [M, K] slice."""
    rd = reduce_dim if reduce_dim < 0 else reduce_dim - x.dim()
    if recipe == "blockwise" and tile is None:
        tile = (1, 128) if rd == -1 else (128, 128)
    M, K = x.shape[-2:]
    lead = x.shape[:-2]
    flat = x.reshape(-1, M, K)
    units = _units_2d(M, K, recipe, rd, tile)
    g0 = max([u[0] for u in units], default=-1) + 1
    g1 = max([u[1] for u in units], default=-1) + 1
    if recipe == "tensorwise":
        g0 = g1 = 1
    elif recipe == "rowwise":
        g0, g1 = (M, 1) if rd == -1 else (1, K)
    scales = torch.ones(flat.shape[0], g0, g1)
    deq = torch.zeros(flat.shape, dtype=torch.float32)
    for b in range(flat.shape[0]):
        for gi, gj, rs, cs in units:
            s, d = _ref_unit(flat[b, rs, cs], fmt, pow2_scales)
            scales[b, gi, gj] = s
            deq[b, rs, cs] = d
    return scales.reshape(*lead, g0, g1), deq.reshape(x.shape)


def quantize_grouped_reference(x_RK, offs_E, recipe, fmt="e4m3", *, pow2_scales=False):
    """(scale table, dequantized rows) by a loop over experts and their units along the rows."""
    R, K = x_RK.shape
    bounds = [0] + offs_E.tolist()
    E = len(offs_E)
    deq = torch.zeros(R, K)
    if recipe == "tensorwise":
        scales = torch.ones(E, 1)
    elif recipe == "rowwise":
        scales = torch.ones(E, K)
    else:
        scales = torch.ones(-(-R // 128) + E, K)
    tile = 0
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if recipe == "tensorwise":
            s, d = _ref_unit(x_RK[lo:hi], fmt, pow2_scales)
            scales[e, 0], deq[lo:hi] = s, d
            continue
        if recipe == "rowwise":
            for k in range(K):
                s, d = _ref_unit(x_RK[lo:hi, k], fmt, pow2_scales)
                scales[e, k], deq[lo:hi, k] = s, d
            continue
        for r0 in range(lo, hi, 128):
            r1 = min(r0 + 128, hi)
            for k in range(K):
                s, d = _ref_unit(x_RK[r0:r1, k], fmt, pow2_scales)
                scales[tile, k], deq[r0:r1, k] = s, d
            tile += 1
    return scales, deq


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---- dense tensors -------------------------------------------------------------------------------

CASES = [
    # (shape, recipe, reduce_dim, tile)
    ((7, 33), "tensorwise", -1, None),
    ((3, 9, 20), "tensorwise", -2, None),
    ((7, 33), "rowwise", -1, None),
    ((9, 20), "rowwise", -2, None),
    ((2, 9, 20), "rowwise", -2, None),
    ((5, 300), "blockwise", -1, None),  # (1, 128), partial last tile of 44
    ((260, 130), "blockwise", -2, None),  # (128, 128), partial on both dims
    ((2, 129, 257), "blockwise", -2, None),  # per-expert weights
    ((4, 256), "blockwise", -1, (1, 128)),  # exact multiples
    ((70, 50), "blockwise", -1, (32, 16)),  # any tile
    ((50, 70), "blockwise", -2, (32, 16)),
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(("shape", "recipe", "reduce_dim", "tile"), CASES)
def test_quantize_matches_the_loop_reference(shape, recipe, reduce_dim, tile, fmt, pow2) -> None:
    g = torch.Generator().manual_seed(hash((shape, recipe, reduce_dim, fmt, pow2)) % 2**31)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    q = quantize(x, recipe, fmt, reduce_dim=reduce_dim, tile=tile, pow2_scales=pow2)
    ref_scale, ref_deq = quantize_reference(x, recipe, fmt, reduce_dim=reduce_dim, tile=tile, pow2_scales=pow2)
    assert q.data.dtype == FP8_DTYPE[fmt] and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32
    _same(q.scale, ref_scale)
    _same(q.dequantize(), ref_deq)


@pytest.mark.parametrize(("shape", "recipe", "reduce_dim", "tile"), CASES)
def test_a_non_finite_unit_dequantizes_to_nan_and_the_others_are_untouched(shape, recipe, reduce_dim, tile) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    for bad in (float("nan"), float("inf"), float("-inf")):
        xb = x.clone()
        xb.view(-1)[5] = bad
        q = quantize(xb, recipe, reduce_dim=reduce_dim, tile=tile)
        ref_scale, ref_deq = quantize_reference(xb, recipe, reduce_dim=reduce_dim, tile=tile)
        _same(q.scale, ref_scale)
        deq = q.dequantize()
        _same(deq, ref_deq)
        assert deq.view(-1)[5].isnan()
        assert q.scale.isnan().sum() == 1  # exactly the one unit holding it
        assert not deq.isnan().all() or recipe == "tensorwise" or xb.numel() == 1


def test_all_zero_units_get_scale_one_and_stay_zero() -> None:
    x = torch.randn(4, 300)
    x[1] = 0
    x[:, 128:256] = 0
    q = quantize(x, "blockwise")
    assert (q.scale[1] == 1).all() and (q.scale[:, 1] == 1).all()
    deq = q.dequantize()
    assert (deq[1] == 0).all() and (deq[:, 128:256] == 0).all()
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        z = quantize(torch.zeros(3, 5), recipe)
        assert (z.scale == 1).all() and (z.dequantize() == 0).all()


def _half_ulp_bound(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half an ulp of ``fmt`` at |v| (v in units of the scale, |v| <= FP8_MAX)."""
    mbits, emin = FORMAT_BITS[fmt]
    a = v.abs().clamp_min(2.0**emin)  # below the normal range the ulp is that of 2**emin
    exponent = torch.floor(torch.log2(a))
    return torch.ldexp(torch.ones_like(a), (exponent - mbits - 1).int())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(("recipe", "reduce_dim"), [("tensorwise", -1), ("rowwise", -1), ("rowwise", -2), ("blockwise", -1), ("blockwise", -2)])
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_error_is_at_most_half_an_ulp_of_the_format_per_element(recipe, reduce_dim, fmt, pow2, magnitude) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(131, 259, generator=g) * torch.exp(torch.randn(131, 259, generator=g) * 2) * magnitude
    q = quantize(x, recipe, fmt, reduce_dim=reduce_dim, pow2_scales=pow2)
    deq = q.dequantize()
    scale = _expand_scale(q, x.shape)
    v = x / scale
    bound = scale * _half_ulp_bound(v, fmt)
    err = (deq - x).abs()
    assert torch.isfinite(deq).all()
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound).max())
    if fmt == "e4m3" and not pow2:
        # the relative form: 2**-4 of the value for normals, scale * 2**-9 absolute for subnormals
        assert (err <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-9) * (1 + 1e-6)).all()
    assert (v.abs() <= FP8_MAX[fmt] * (1 + 1e-6)).all()  # the unit's amax lands on the format's top


def _expand_scale(q: Fp8Tensor, shape) -> torch.Tensor:
    """The scale of each element, by dequantizing a tensor of ones in the same units."""
    ones = torch.ones(shape, dtype=q.data.dtype)
    return Fp8Tensor(ones, q.scale, q.recipe, q.fmt, q.reduce_dim, q.tile).dequantize()


def test_tiny_and_huge_rows_keep_their_own_scales() -> None:
    x = torch.randn(3, 200)
    x[0] *= 1e-30
    x[2] *= 1e30
    for recipe in ("rowwise", "blockwise"):
        deq = quantize(x, recipe).dequantize()
        rel = ((deq - x).abs() / x.abs()).max(dim=1).values
        assert (rel <= 2.0**-4 + 1e-6).all() or recipe == "blockwise"
        assert torch.isfinite(deq).all()
        for i in range(3):
            assert (deq[i] - x[i]).abs().max() <= x[i].abs().max() * 2.0**-4


def test_pow2_scales_are_powers_of_two_not_below_amax_over_max() -> None:
    x = torch.randn(64, 384) * 37
    q = quantize(x, "blockwise", pow2_scales=True)
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()
    amax = x.abs().reshape(64, 3, 128).amax(-1)
    assert (q.scale >= amax / 448).all() and (q.scale < 2 * amax / 448).all()


@pytest.mark.parametrize(("recipe", "reduce_dim", "grid"), [("tensorwise", -1, (1, 1)), ("rowwise", -1, (0, 1)), ("rowwise", -2, (1, 33)), ("blockwise", -1, (0, 1)), ("blockwise", -2, (0, 1))])
def test_zero_rows(recipe, reduce_dim, grid) -> None:
    x = torch.zeros(0, 33)
    q = quantize(x, recipe, reduce_dim=reduce_dim)
    assert q.data.shape == (0, 33) and tuple(q.scale.shape) == grid
    assert q.dequantize().shape == (0, 33)
    assert quantize(torch.zeros(0, 5, 7), recipe, reduce_dim=reduce_dim).dequantize().shape == (0, 5, 7)


def test_bf16_input_and_fake_quantize_keep_the_dtype() -> None:
    x = torch.randn(6, 140, dtype=torch.bfloat16)
    y = fake_quantize(x, "blockwise")
    assert y.dtype == torch.bfloat16
    _, ref = quantize_reference(x.float(), "blockwise")
    _same(y, ref.to(torch.bfloat16))


def test_index_rows_and_transpose() -> None:
    x = torch.randn(10, 200)
    idx = torch.tensor([9, 0, 3, 3])
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        q = quantize(x, recipe)
        sub = q.index_rows(idx)
        _same(sub.dequantize(), q.dequantize()[idx])
        if recipe != "tensorwise":
            _same(sub.dequantize(), quantize(x[idx], recipe).dequantize())
    w = quantize(torch.randn(200, 300), "blockwise", reduce_dim=-2)
    with pytest.raises(ValueError, match="units of one row|reduce_dim=-1"):
        w.index_rows(idx)
    wt = w.transpose()
    assert wt.reduce_dim == -1 and wt.shape == (300, 200)
    _same(wt.dequantize(), w.dequantize().t())


def test_bad_input_is_refused_with_the_fix() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        quantize(x, "colwise")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize(x, "rowwise", "e3m4")
    with pytest.raises(ValueError, match="reduce_dim"):
        quantize(x, "rowwise", reduce_dim=-3)
    with pytest.raises(ValueError, match="blockwise recipe only"):
        quantize(x, "rowwise", tile=(1, 128))
    with pytest.raises(ValueError, match="pair of positive ints"):
        quantize(x, "blockwise", tile=(0, 128))
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, 8, dtype=torch.int64), "rowwise")
    with pytest.raises(ValueError, match="2 or more dims"):
        quantize(torch.ones(8), "rowwise")
    with pytest.raises(ValueError, match=r"rows \[R, K\]"):
        quantize_grouped_rows(torch.ones(2, 3, 4), torch.tensor([2], dtype=torch.int32), "rowwise")


# ---- grouped rows --------------------------------------------------------------------------------

GROUPS = [
    [3, 0, 7, 130],  # an empty expert, a partial tile, a tile boundary crossing
    [0, 0, 0],  # nothing routed
    [300],  # one expert gets everything
    [0, 257, 0],  # everything to the middle expert
    [128, 1, 129],
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("counts", GROUPS)
def test_grouped_rows_match_the_loop_reference(counts, recipe, fmt) -> None:
    R_used = sum(counts)
    R = R_used + 5  # rows past offs_E[-1]
    g = torch.Generator().manual_seed(len(counts) * 7 + R)
    x = torch.randn(R, 9, generator=g) * torch.exp(torch.randn(R, 9, generator=g) * 2)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    q = quantize_grouped_rows(x, offs, recipe, fmt)
    ref_scale, ref_deq = quantize_grouped_reference(x, offs, recipe, fmt)
    assert q.reduce_dim == -2 and q.grouped
    _same(q.scale, ref_scale)
    _same(q.dequantize(), ref_deq)
    assert (q.dequantize()[R_used:] == 0).all()


def test_grouped_units_never_cross_an_expert_boundary() -> None:
    # expert 0's rows are huge, expert 1's tiny: shared units would flush expert 1 to zero
    x = torch.cat([torch.randn(5, 4) * 1e20, torch.randn(6, 4) * 1e-3])
    offs = torch.tensor([5, 11], dtype=torch.int32)
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        deq = quantize_grouped_rows(x, offs, recipe).dequantize()
        assert ((deq[5:] - x[5:]).abs() <= x[5:].abs().max() * 2.0**-4).all()


def test_grouped_non_finite_stays_in_its_unit() -> None:
    x = torch.randn(300, 3)
    x[140, 1] = float("inf")
    offs = torch.tensor([100, 300], dtype=torch.int32)
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        q = quantize_grouped_rows(x, offs, recipe)
        _same(q.dequantize(), quantize_grouped_reference(x, offs, recipe)[1])
        deq = q.dequantize()
        assert torch.isfinite(deq[:100]).all()
        assert deq[140, 1].isnan()


def test_grouped_row_units_numbering() -> None:
    offs = torch.tensor([3, 3, 260, 261], dtype=torch.int32)
    unit_R, U = grouped_row_units(offs, 265, "blockwise")
    assert U == -(-265 // 128) + 4
    expected = [0] * 3 + [1] * 128 + [2] * 128 + [3] + [4] + [U] * 4
    assert unit_R.tolist() == expected


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "tensorwise"])
@pytest.mark.parametrize("reduce_dim", [-1, -2])
def test_bf16_quantizes_to_the_bytes_of_its_fp32_widening(recipe: str, reduce_dim: int) -> None:
    """The contract that makes CPU and CUDA agree for bf16 sources: they take the padded fp32 ops,
    whose bytes equal the quantization of ``x.float()`` (fp32 division, one rounding to FP8)."""
    import importlib

    Q = importlib.import_module("lightning_moe.ops.fp8.quantize")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 256, 384, generator=g) * torch.logspace(-20, 3, 384)).to(torch.bfloat16)
    assert not Q._two_pass_exact_for(x) and Q._two_pass_exact_for(x.float())
    a, b = Q.quantize(x, recipe, "e4m3", reduce_dim=reduce_dim), Q.quantize(x.float(), recipe, "e4m3", reduce_dim=reduce_dim)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
