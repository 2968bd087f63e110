"""The two-pass quantization and dequantization (exact unit grids) on CUDA: bitwise the padded fp32
path on the same device and the CPU's result, with NaN, inf, zero units and negative amaxes."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

Q = importlib.import_module("lightning_moe.ops.fp8.quantize")


def _hard_input(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, 512, generator=g) * torch.logspace(-30, 3, 512)
    x[0, 3, 5] = float("nan")
    x[1, 130, 200] = float("-inf")
    x[2, :128, :128] = 0.0
    x[0, 200, 300:] = -x[0, 200, 300:].abs() * 1e3
    return x.to(dtype)


def _same(a, b) -> None:  # noqa: ANN001
    assert torch.equal(a.data.cpu().view(torch.uint8), b.data.cpu().view(torch.uint8))
    assert torch.equal(a.scale.cpu().isnan(), b.scale.cpu().isnan())
    assert torch.equal(a.scale.cpu().nan_to_num(7.0), b.scale.cpu().nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "tensorwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("reduce_dim", [-1, -2])
def test_two_pass_quantize_equals_padded_and_cpu(monkeypatch, dtype, recipe, fmt, reduce_dim) -> None:
    x = _hard_input(dtype)
    fast = Q.quantize(x.cuda(), recipe, fmt, reduce_dim=reduce_dim)
    assert "cuda" not in Q._NO_FP8_STORE  # the two-pass path can run here
    assert Q._two_pass_exact_for(x.cuda()) == (dtype != torch.bfloat16)  # bf16 sources take the padded path
    cpu = Q.quantize(x, recipe, fmt, reduce_dim=reduce_dim)
    monkeypatch.setattr(Q, "_divides_grid", lambda *a: False)
    padded = Q.quantize(x.cuda(), recipe, fmt, reduce_dim=reduce_dim)
    _same(fast, padded)
    _same(fast, cpu)
    monkeypatch.undo()
    deq = fast.dequantize(torch.bfloat16)
    monkeypatch.setattr(Q, "_divides_grid", lambda *a: False)
    ref = fast.dequantize(torch.bfloat16)
    assert torch.equal(deq.isnan(), ref.isnan()) and torch.equal(deq.nan_to_num(3.0), ref.nan_to_num(3.0))


def test_the_weight_cache_retires_copies_at_an_optimizer_step_on_cuda() -> None:
    from lightning_moe.ops.fp8.weight_cache import quantized_weight

    w = torch.nn.Parameter(torch.randn(2, 256, 384, device="cuda"))
    a = quantized_weight(w, "fprop", "blockwise", False, cache=True)
    assert quantized_weight(w, "fprop", "blockwise", False, cache=True) is a
    w.grad = torch.ones_like(w)
    torch.optim.AdamW([w], lr=1e-2, fused=True).step()
    b = quantized_weight(w, "fprop", "blockwise", False, cache=True)
    assert b is not a
    _same(b, Q.quantize(w.detach(), "blockwise", "e4m3", reduce_dim=-2))
