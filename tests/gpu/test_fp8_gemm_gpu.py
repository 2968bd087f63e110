"""FP8 GEMMs on the GPU: every backend equals ``emulate``; quantization on CUDA equals the CPU's.

Legend: M rows, K contracted width, N output width, E experts, R rows sorted by expert.

``emulate`` computes the fp32 sum of products of the dequantized operands. Hopper's FP8 tensor
cores accumulate with fewer bits than fp32 (measured on H200: fp32 outputs within 3.2e-4 of the
largest output), so fp32 outputs agree to 2e-3 of the largest output, bf16 outputs to 1e-2 (one
bf16 rounding). Sizes are chosen off
torch's grid (rows, K and N not multiples of 16) so the padding is exercised.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9+", allow_module_level=True)

from lightning_moe.ops.fp8 import quantize, quantize_grouped_rows  # noqa: E402
from lightning_moe.ops.fp8 import gemm  # noqa: E402
from lightning_moe.ops.fp8.gemm import fp8_grouped_mm, fp8_grouped_wgrad, fp8_mm, resolve_fp8_backend  # noqa: E402

DEV = torch.device("cuda")
COUNTS = [
    [37, 0, 300, 5],  # an empty expert, rows not multiples of 16
    [0, 0, 0],  # nothing routed
    [0, 333, 0],  # one expert gets everything
    [128, 256],
]


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts, device=DEV), 0).to(torch.int32)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = float(ref.float().abs().max()) if ref.numel() else 1.0
    tol = 2e-3 if ref.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * max(scale, 1e-30), equal_nan=True)


def _blockwise_or_skip(pair: str) -> None:
    reason = gemm._blockwise_probe(torch.cuda.current_device(), pair)
    if reason is not None:
        pytest.skip(f"torch does not run blockwise {pair} here: {reason}")


def test_resolve_picks_torch_on_this_gpu() -> None:
    assert resolve_fp8_backend("auto", DEV, "rowwise") == "torch"
    assert resolve_fp8_backend("emulate", DEV, "rowwise") == "emulate"
    with pytest.raises(ValueError, match="blockwise recipe only"):
        resolve_fp8_backend("cutlass", DEV, "rowwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("M", "K", "N"), [(77, 300, 130), (256, 512, 384), (1, 16, 16), (0, 64, 32)])
def test_fp8_mm_torch_equals_emulate(recipe, out_dtype, M, K, N) -> None:
    if recipe == "blockwise":
        _blockwise_or_skip("1x128,128x128")
    a = quantize(torch.randn(M, K, device=DEV), recipe)
    b = quantize(torch.randn(K, N, device=DEV), recipe, reduce_dim=-2)
    _close(fp8_mm(a, b, out_dtype, "torch"), fp8_mm(a, b, out_dtype, "emulate"))


def test_fp8_mm_e5m2_gradient_operand() -> None:
    a = quantize(torch.randn(50, 200, device=DEV), "tensorwise", "e5m2")
    b = quantize(torch.randn(200, 70, device=DEV), "tensorwise", reduce_dim=-2)
    _close(fp8_mm(a, b, torch.bfloat16, "torch"), fp8_mm(a, b, torch.bfloat16, "emulate"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize(("fmt", "out_dtype"), [("e4m3", torch.bfloat16), ("e4m3", torch.float32), ("e5m2", torch.bfloat16)])
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_mm_torch_equals_emulate(counts, recipe, fmt, out_dtype) -> None:
    if recipe == "blockwise":
        _blockwise_or_skip("1x128,128x128")
        if fmt == "e5m2":
            pytest.skip("blockwise runs e4m3 only (checked in test_blockwise_e5m2_is_refused_by_name)")
    E, K, N = len(counts), 200, 136
    R = sum(counts) + 7  # rows past offs_E[-1] must come out zero
    a = quantize(torch.randn(R, K, device=DEV), recipe, fmt)
    b = quantize(torch.randn(E, K, N, device=DEV), recipe, reduce_dim=-2)
    offs = _offs(counts)
    y = fp8_grouped_mm(a, b, offs, out_dtype, "torch")
    _close(y, fp8_grouped_mm(a, b, offs, out_dtype, "emulate"))
    assert (y[sum(counts) :] == 0).all()


def test_blockwise_e5m2_is_refused_by_name() -> None:
    a = quantize(torch.randn(8, 128, device=DEV), "blockwise", "e5m2")
    b = quantize(torch.randn(1, 128, 128, device=DEV), "blockwise", reduce_dim=-2)
    with pytest.raises(ValueError, match="blockwise recipe with e4m3 operands only"):
        fp8_grouped_mm(a, b, _offs([8]), torch.bfloat16, "torch")


def test_grouped_mm_a_nan_row_stays_in_its_row() -> None:
    x = torch.randn(40, 64, device=DEV)
    x[5, 7] = float("nan")
    b = quantize(torch.randn(2, 64, 32, device=DEV), "rowwise", reduce_dim=-2)
    y = fp8_grouped_mm(quantize(x, "rowwise"), b, _offs([20, 20]), torch.bfloat16, "torch")
    assert y[5].isnan().all()
    assert torch.isfinite(torch.cat([y[:5], y[6:]])).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize(("fmt", "out_dtype"), [("e4m3", torch.bfloat16), ("e4m3", torch.float32), ("e5m2", torch.bfloat16)])
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(("K", "N"), [(72, 200), (64, 128)])
def test_grouped_wgrad_torch_equals_emulate(counts, recipe, fmt, out_dtype, K, N) -> None:
    if recipe == "blockwise":
        _blockwise_or_skip("1x128,1x128")
        if fmt == "e5m2":
            pytest.skip("blockwise runs e4m3 only (checked in test_blockwise_e5m2_is_refused_by_name)")
    R = sum(counts) + 7
    offs = _offs(counts)
    x = quantize_grouped_rows(torch.randn(R, K, device=DEV), offs, recipe)
    dy = quantize_grouped_rows(torch.randn(R, N, device=DEV) * 1e-3, offs, recipe, fmt)
    dw = fp8_grouped_wgrad(x, dy, offs, out_dtype, "torch")
    _close(dw, fp8_grouped_wgrad(x, dy, offs, out_dtype, "emulate"))
    for e, n in enumerate(counts):
        if n == 0:
            assert (dw[e] == 0).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_on_cuda_equals_cpu_and_never_syncs(recipe, fmt, pow2) -> None:
    x = torch.randn(300, 260) * torch.exp(torch.randn(300, 260) * 3)
    x[7, 9] = float("nan")
    x[200, 3] = float("inf")
    xg = x.to(DEV)
    offs = _offs([100, 0, 150])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = quantize(xg, recipe, fmt, pow2_scales=pow2)
        w = quantize(xg, recipe, fmt, reduce_dim=-2, pow2_scales=pow2)
        g = quantize_grouped_rows(xg, offs, recipe, fmt, pow2_scales=pow2)
        deq = (q.dequantize(), w.dequantize(), g.dequantize())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    qc = quantize(x, recipe, fmt, pow2_scales=pow2)
    wc = quantize(x, recipe, fmt, reduce_dim=-2, pow2_scales=pow2)
    gc = quantize_grouped_rows(x, offs.cpu(), recipe, fmt, pow2_scales=pow2)
    for dev_t, cpu_t, d in ((q, qc, deq[0]), (w, wc, deq[1]), (g, gc, deq[2])):
        torch.testing.assert_close(dev_t.scale.cpu(), cpu_t.scale, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(dev_t.data.cpu().float(), cpu_t.data.float(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(d.cpu(), cpu_t.dequantize(), rtol=0, atol=0, equal_nan=True)
