"""The FP8 kernels (csrc/fp8_quant.cu, csrc/cutlass/fp8_blockwise_grouped*) against their torch references.

Legend: R rows, S source rows, H row width, F expert FFN width, K contracted width, N output width,
E experts.

Row quantization must equal ``quantize.py`` on the same GPU exactly: the FP8 bytes and the fp32
scales compared as bit patterns (NaN scales included). Inputs: random rows over a wide dynamic range
(so that FP8 subnormals, ties and the top of the range are hit), sizes that are not multiples of 128
or of 4 (the scalar path), zero rows, rows holding NaN or inf, tiny (1e-30) and huge (1e30) rows, and
no rows at all. Each op runs right after blocks of its outputs' sizes were filled with 0x55 bytes and
freed, so the allocator is likely to hand poisoned memory back and an unwritten element shows.

The CUTLASS GEMM must equal the emulated GEMM (dequantize, fp32 matmul per expert) to bf16 rounding
plus fp32 summation order: relative Frobenius error per expert <= 1e-2, on ragged experts with empty
ones, every row in one expert, row counts that are not multiples of 128, K and N that are not.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the FP8 kernels run only there)", allow_module_level=True)

from lightning_moe.ops.build import load_extension  # noqa: E402
from lightning_moe.ops.fp8 import kernels  # noqa: E402
from lightning_moe.ops.fp8.quantize import quantize  # noqa: E402

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 256), (1, 128), (37, 300), (5, 129), (9, 7), (64, 7168)]


@pytest.fixture(scope="module")
def ops():
    return load_extension(mode="csrc")  # a failed build raises with the compiler's first error


def _poison(*shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> None:
    blocks = [torch.empty(shape, dtype=dt, device=DEV) for shape, dt in shapes_dtypes]
    for b in blocks:
        b.view(torch.uint8).fill_(0x55)
    del blocks


def _rows(R: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows: per-row magnitudes over 2^-12 .. 2^12 and values spanning 2^-24 of each row's max
    (FP8 subnormals after scaling), a few special rows, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-12, 13, (R, 1), generator=g).float())
    x = torch.randn(R, H, generator=g) * torch.exp2(-torch.randint(0, 24, (R, H), generator=g).float()) * mag
    if R >= 6 and H >= 2:
        x[1] = 0.0  # a zero row: scale 1
        x[2, H // 2] = float("nan")  # a NaN: the row's unit gets a NaN scale
        x[3, 0] = float("inf")
        x[4, -1] = -float("inf")
        if dtype == torch.float32:
            x[5] *= 1e-30 / x[5].abs().max().clamp_min(1e-38)  # tiny: scales floored at FLT_MIN
            x[0] *= 1e30 / x[0].abs().max().clamp_min(1e-38)  # huge
    return x.to(DEV, dtype)


def _assert_same(got, want) -> None:
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
    assert got.recipe == want.recipe and got.fmt == want.fmt and got.tile == want.tile
    assert got.data.dtype == want.data.dtype
    bad = got.data.view(torch.uint8) != want.data.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} FP8 bytes differ, first at {bad.nonzero()[0].tolist()}"
    sbad = got.scale.contiguous().view(torch.int32) != want.scale.contiguous().view(torch.int32)
    assert not sbad.any(), f"{int(sbad.sum())} scales differ: {got.scale[sbad][:4]} vs {want.scale[sbad][:4]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_equals_the_reference(ops, dtype, shape, recipe, fmt, pow2) -> None:
    R, H = shape
    x = _rows(R, H, dtype, seed=R * 1000 + H)
    want = quantize(x, recipe, fmt, reduce_dim=-1, pow2_scales=pow2)
    _poison(((R, H), torch.uint8), (tuple(want.scale.shape), torch.float32))
    got = kernels.quantize_rows_fp8(x, recipe, fmt, pow2_scales=pow2)
    _assert_same(got, want)


def test_non_finite_units_dequantize_to_nan_and_leave_others_alone(ops) -> None:
    x = _rows(8, 384, torch.bfloat16, seed=3)
    got = kernels.quantize_rows_fp8(x, "blockwise")
    deq = got.dequantize()
    assert deq[2, 128:256].isnan().all() and not deq[2, :128].isnan().any()  # NaN at column 192
    assert deq[3, :128].isnan().all() and deq[4, 256:].isnan().all()
    assert torch.isfinite(deq[[0, 1, 5, 6, 7]]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 256), (48, 300), (33, 7168), (20, 129)])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_permute_quantize_equals_gather_then_quantize(ops, dtype, shape, recipe) -> None:
    S, H = shape
    x = _rows(S, H, dtype, seed=S + H)
    g = torch.Generator().manual_seed(7)
    R = 3 * S + 2
    if S:
        src = torch.randint(-1, S, (R,), generator=g, dtype=torch.int32).to(DEV)
    else:
        src = torch.full((R,), -1, dtype=torch.int32, device=DEV)
    want = kernels.permute_quantize_reference(x, src, recipe, "e4m3")
    _poison(((R, H), torch.uint8), (tuple(want.scale.shape), torch.float32))
    got = kernels.permute_quantize(x, src, recipe, "e4m3")
    _assert_same(got, want)
    assert (got.data[src == -1].view(torch.uint8) == 0).all() and (got.scale[src == -1] == 1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 256), (40, 768), (17, 300), (6, 129)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_quantize_equals_swiglu_then_quantize(ops, dtype, shape, weighted, pow2) -> None:
    R, F = shape
    g = torch.Generator().manual_seed(R + F)
    h = (torch.randn(R, 2 * F, generator=g) * 3).to(DEV, dtype)
    if R > 3:
        h[3, 5] = float("nan")
    w = torch.rand(R, generator=g).to(DEV) if weighted else None
    want = kernels.swiglu_quantize_reference(h, w, "blockwise", "e4m3", pow2_scales=pow2)
    _poison(((R, F), torch.uint8), (tuple(want.scale.shape), torch.float32))
    got = kernels.swiglu_quantize(h, w, "blockwise", "e4m3", pow2_scales=pow2)
    _assert_same(got, want)
    got_row = kernels.swiglu_quantize(h, w, "rowwise", "e5m2", pow2_scales=pow2)
    _assert_same(got_row, kernels.swiglu_quantize_reference(h, w, "rowwise", "e5m2", pow2_scales=pow2))


def test_swiglu_quantize_is_close_to_the_torch_swiglu(ops) -> None:
    from lightning_moe.ops.swiglu import weighted_swiglu_reference

    g = torch.Generator().manual_seed(11)
    h = torch.randn(64, 2 * 768, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(64, generator=g).to(DEV)
    got = kernels.swiglu_quantize(h, w).dequantize()
    want = quantize(weighted_swiglu_reference(h, w), "blockwise").dequantize()
    assert torch.allclose(got, want, rtol=0.07, atol=1e-6)  # an e4m3 step apart at most


# ---- the CUTLASS blockwise grouped GEMM ----------------------------------------------------------


def _counts(E: int, R: int, g: torch.Generator, empty: tuple[int, ...]) -> list[int]:
    weights = torch.rand(E, generator=g) + 0.05
    weights[list(empty)] = 0
    counts = (weights / weights.sum() * R).floor().long()
    counts[int(weights.argmax())] += R - int(counts.sum())
    return counts.tolist()


def _emulated(a, b, counts: list[int], R: int) -> torch.Tensor:
    a32, b32 = a.dequantize(), b.dequantize()
    out = torch.zeros(R, b32.shape[2], device=DEV)
    lo = 0
    for e, c in enumerate(counts):
        out[lo : lo + c] = a32[lo : lo + c] @ b32[e]
        lo += c
    return out


CASES = [  # (E, rows used, rows in total, K, N, empty experts)
    (4, 1000, 1000, 512, 384, (1,)),
    (8, 777, 800, 320, 272, (0, 5)),  # K and N not multiples of 128; rows past offs[-1]
    (3, 300, 300, 2048, 1024, (0, 2)),  # every row in one expert
    (2, 0, 64, 256, 256, (0, 1)),  # no expert has rows: the output is all zeros
    (5, 130, 130, 200, 136, ()),  # K and N not multiples of 16: padded in the wrapper
]


@pytest.mark.usefixtures("needs_cutlass")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", ["n-major", "k-major"])
def test_cutlass_blockwise_grouped_mm_equals_emulation(case, layout) -> None:
    E, used, R, K, N, empty = case
    g = torch.Generator().manual_seed(E * 100 + K)
    counts = _counts(E, used, g, empty) if used else [0] * E
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)
    x = (torch.randn(R, K, generator=g)).to(DEV, torch.bfloat16)
    a = kernels.quantize_rows_fp8(x, "blockwise")
    if layout == "n-major":
        w = (torch.randn(E, K, N, generator=g) * 0.05).to(DEV, torch.bfloat16)
        b = quantize(w, "blockwise", reduce_dim=-2)
    else:  # the transpose of an [E, N, K] quantization: K-major data, as the data-gradient GEMM has it
        w = (torch.randn(E, N, K, generator=g) * 0.05).to(DEV, torch.bfloat16)
        b = quantize(w, "blockwise", reduce_dim=-1, tile=(128, 128)).transpose()
    assert kernels.cutlass_blockwise_supported(a, b)
    torch.full((R, N), float("nan"), device=DEV, dtype=torch.bfloat16)  # poison the allocator's block
    out = kernels.cutlass_blockwise_grouped_mm(a, b, offs)
    assert out.shape == (R, N) and out.dtype == torch.bfloat16
    want = _emulated(a, b, counts, R)
    lo = 0
    for e, c in enumerate(counts):
        if c:
            err = (out[lo : lo + c].float() - want[lo : lo + c]).norm() / want[lo : lo + c].norm().clamp_min(1e-30)
            assert err <= 1e-2, f"expert {e}: relative error {float(err):.3g}"
        lo += c
    assert (out[used:] == 0).all(), "rows past offs[-1] must be zero"


@pytest.mark.usefixtures("needs_cutlass")
def test_cutlass_blockwise_nan_rows_stay_nan() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 256, generator=g).to(DEV, torch.bfloat16)
    x[7, 3] = float("nan")
    a = kernels.quantize_rows_fp8(x, "blockwise")
    b = quantize((torch.randn(2, 256, 128, generator=g) * 0.05).to(DEV, torch.bfloat16), "blockwise", reduce_dim=-2)
    out = kernels.cutlass_blockwise_grouped_mm(a, b, torch.tensor([100, 256], dtype=torch.int32, device=DEV))
    assert out[7].isnan().all()
    assert torch.isfinite(out[torch.arange(256, device=DEV) != 7]).all()
