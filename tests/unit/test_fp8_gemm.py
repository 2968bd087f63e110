"""FP8 GEMMs on the emulate backend against per-expert references built from ``fake_quantize``.

Legend: M rows, K contracted width, N output width, E experts, R rows sorted by expert.

The references quantize each operand the way its units are defined, independently of the
package's batched and grouped code: each expert weight ``w[e]`` as its own 2-D tensor, and each
expert's rows of a weight-gradient operand as their own tensor contracted over its rows
(``reduce_dim=-2``; blockwise tile ``(1, 128)``: 128 rows x 1 column starting at the expert's first
row). The GPU backends are compared with emulate in ``tests/gpu/test_fp8_gemm_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.ops.fp8 import fake_quantize, quantize, quantize_grouped_rows
from lightning_moe.ops.fp8.gemm import fp8_grouped_mm, fp8_grouped_wgrad, fp8_mm, resolve_fp8_backend

RECIPES = ["tensorwise", "rowwise", "blockwise"]
COUNTS = [
    [5, 0, 140, 2],  # an empty expert, more than one 128-row tile
    [0, 0, 0],  # nothing routed
    [0, 200, 0],  # one expert gets everything
    [17],
]


# every recipe on every routing in e4m3; e5m2 (the gradient format of tensorwise) on the first routing
GROUPED_CASES = [(c, r, "e4m3") for c in COUNTS for r in RECIPES] + [(COUNTS[0], r, "e5m2") for r in RECIPES]


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("M", "K", "N"), [(7, 300, 130), (0, 64, 32), (33, 16, 1)])
def test_fp8_mm_equals_fake_quantized_matmul(recipe, M, K, N) -> None:
    a = torch.randn(M, K)
    w = torch.randn(K, N)
    qa = quantize(a, recipe, reduce_dim=-1)
    qw = quantize(w, recipe, "e4m3", reduce_dim=-2)
    ref = fake_quantize(a, recipe, reduce_dim=-1) @ fake_quantize(w, recipe, reduce_dim=-2)
    y = fp8_mm(qa, qw, torch.float32, "emulate")
    assert y.shape == (M, N) and y.dtype == torch.float32
    _close(y, ref)
    assert fp8_mm(qa, qw, torch.bfloat16, "emulate").dtype == torch.bfloat16


def test_square_weight_tiles_serve_the_transposed_gemm() -> None:
    w = torch.randn(200, 300)
    qw = quantize(w, "blockwise", reduce_dim=-2)  # (128, 128)
    dy = torch.randn(5, 300)
    y = fp8_mm(quantize(dy, "blockwise"), qw.transpose(), torch.float32, "emulate")
    _close(y, fake_quantize(dy, "blockwise") @ fake_quantize(w, "blockwise", reduce_dim=-2).t())
    with pytest.raises(ValueError, match="contracts over its dim -2"):
        fp8_mm(quantize(dy, "rowwise"), quantize(w, "rowwise", reduce_dim=-2).transpose(), torch.float32, "emulate")


@pytest.mark.parametrize(("counts", "recipe", "fmt"), GROUPED_CASES)
def test_grouped_mm_equals_a_per_expert_reference(counts, recipe, fmt) -> None:
    E, K, N = len(counts), 130, 24
    R = sum(counts) + 3  # rows past offs_E[-1]
    x = torch.randn(R, K)
    w = torch.randn(E, K, N)
    offs = _offs(counts)
    y = fp8_grouped_mm(quantize(x, recipe, fmt), quantize(w, recipe, reduce_dim=-2), offs, torch.float32, "emulate")
    xq = fake_quantize(x, recipe, fmt)
    ref = torch.zeros(R, N)
    lo = 0
    for e, n in enumerate(counts):
        ref[lo : lo + n] = xq[lo : lo + n] @ fake_quantize(w[e], recipe, reduce_dim=-2)
        lo += n
    _close(y, ref)
    assert (y[sum(counts) :] == 0).all()


@pytest.mark.parametrize(("counts", "recipe", "fmt"), GROUPED_CASES)
def test_grouped_wgrad_quantizes_per_expert_along_its_rows(counts, recipe, fmt) -> None:
    E, K, N = len(counts), 24, 10
    R = sum(counts) + 3
    x = torch.randn(R, K)
    dy = torch.randn(R, N) * 1e-3
    offs = _offs(counts)
    dw = fp8_grouped_wgrad(
        quantize_grouped_rows(x, offs, recipe), quantize_grouped_rows(dy, offs, recipe, fmt), offs, torch.float32, "emulate"
    )
    tile = (1, 128) if recipe == "blockwise" else None
    ref = torch.zeros(E, K, N)
    lo = 0
    for e, n in enumerate(counts):
        if n:
            xe = fake_quantize(x[lo : lo + n], recipe, reduce_dim=-2, tile=tile)
            dye = fake_quantize(dy[lo : lo + n], recipe, fmt, reduce_dim=-2, tile=tile)
            ref[e] = xe.t() @ dye
        lo += n
    assert dw.shape == (E, K, N)
    _close(dw, ref)
    for e, n in enumerate(counts):
        if n == 0:
            assert (dw[e] == 0).all()


def test_zero_rows_and_nan_rows() -> None:
    offs = torch.tensor([0, 0], dtype=torch.int32)
    w = quantize(torch.randn(2, 16, 8), "rowwise", reduce_dim=-2)
    y = fp8_grouped_mm(quantize(torch.zeros(0, 16), "rowwise"), w, offs, torch.float32, "emulate")
    assert y.shape == (0, 8)
    x = torch.randn(6, 16)
    x[2, 3] = float("nan")
    y = fp8_grouped_mm(quantize(x, "rowwise"), w, torch.tensor([3, 6], dtype=torch.int32), torch.float32, "emulate")
    assert y[2].isnan().all() and torch.isfinite(y[[0, 1, 3, 4, 5]]).all()


def test_resolve_fp8_backend_and_bad_input() -> None:
    assert resolve_fp8_backend("emulate", torch.device("cpu"), "blockwise") == "emulate"
    for requested in ("auto", "torch", "cutlass"):
        with pytest.raises(ValueError, match=r"FP8 on CPU runs only as emulation; set Fp8Config\(backend='emulate'\)"):
            resolve_fp8_backend(requested, "cpu", "rowwise")
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"):
        resolve_fp8_backend("fast", "cpu", "rowwise")
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        resolve_fp8_backend("emulate", "cpu", "colwise")
    a = quantize(torch.randn(4, 32), "rowwise")
    b = quantize(torch.randn(32, 8), "rowwise", reduce_dim=-2)
    with pytest.raises(ValueError, match="FP8 on CPU runs only as emulation"):
        fp8_mm(a, b, torch.float32, "torch")
    with pytest.raises(ValueError, match="reduce_dim=-2"):
        fp8_mm(a, quantize(torch.randn(32, 8), "rowwise", reduce_dim=-1), torch.float32, "emulate")
    with pytest.raises(ValueError, match="K differ"):
        fp8_mm(a, quantize(torch.randn(16, 8), "rowwise", reduce_dim=-2), torch.float32, "emulate")
    with pytest.raises(TypeError, match="Fp8Tensor"):
        fp8_mm(torch.randn(4, 32), b, torch.float32, "emulate")
    w = quantize(torch.randn(2, 32, 8), "rowwise", reduce_dim=-2)
    with pytest.raises(ValueError, match="2 entries for 2 experts|entries for 2 experts"):
        fp8_grouped_mm(a, w, torch.tensor([4], dtype=torch.int32), torch.float32, "emulate")
    offs = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped-rows"):
        fp8_grouped_wgrad(a, quantize_grouped_rows(torch.randn(4, 8), offs, "rowwise"), offs, torch.float32, "emulate")
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"):
        fp8_mm(a, b, torch.float32, "auto")


@pytest.mark.parametrize("counts", [[5, 0, 140, 2], [0, 0], [16, 32], [1]])
def test_aligned_segments_place_each_expert_on_a_16_row_boundary(counts) -> None:
    from lightning_moe.ops.fp8.gemm import aligned_segments

    R = sum(counts) + 4
    offs = _offs(counts)
    dest_R, padded_offs_E, Rp = aligned_segments(offs, R)
    assert Rp % 16 == 0 and int(padded_offs_E[-1]) <= Rp
    lo, start = 0, 0
    for e, n in enumerate(counts):
        assert start % 16 == 0
        assert dest_R[lo : lo + n].tolist() == list(range(start, start + n))
        assert int(padded_offs_E[e]) == start + -(-n // 16) * 16
        lo, start = lo + n, int(padded_offs_E[e])
    assert (dest_R[lo:] == Rp).all()


@pytest.mark.parametrize("colmajor", [False, True])
@pytest.mark.parametrize(("pad_k", "pad_n"), [(0, 0), (3, 9)])
def test_b_operand_is_column_major_zero_padded_and_never_copies_what_needs_nothing(colmajor, pad_k, pad_n) -> None:
    from lightning_moe.ops.fp8.gemm import _b_operand

    x = torch.randn(3, 5, 7).to(torch.float8_e4m3fn)
    if colmajor:
        x = quantize(torch.randn(3, 5, 7), "rowwise", reduce_dim=-2).data  # what quantize gives a weight
        assert x.stride(-2) == 1
    y = _b_operand(x, pad_k, pad_n)
    assert y.shape == (3, 5 + pad_k, 7 + pad_n) and y.stride(-2) == 1
    assert torch.equal(y[:, :5, :7].float(), x.float())
    assert (y.float()[:, 5:] == 0).all() and (y.float()[:, :, 7:] == 0).all()
    if colmajor and pad_k == pad_n == 0:
        assert y.data_ptr() == x.data_ptr()
