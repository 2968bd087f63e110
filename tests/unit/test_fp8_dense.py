"""FP8 dense layers: ``fp8_linear`` against an independent fake-quantized reference, the model switch.

The reference quantizes each GEMM operand with ``fake_quantize`` in the units the recipe names and
multiplies in fp32, so it shares no code with ``ops/fp8/linear.py`` beyond the quantizer (which has
its own reference tests in ``test_fp8_quantize.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_moe.config import Fp8Config, MoEConfig
from lightning_moe.models.fp8_dense import convert_linears_to_fp8, eligible_linears
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.ops.fp8.expert_mlp import Fp8Options
from lightning_moe.ops.fp8.linear import Fp8Linear, fp8_linear
from lightning_moe.ops.fp8.quantize import fake_quantize

RECIPES = ("tensorwise", "rowwise", "blockwise")


def _fq(t: torch.Tensor, recipe: str, fmt: str, reduce_dim: int, tile: tuple[int, int] | None = None) -> torch.Tensor:
    return fake_quantize(t, recipe, fmt, reduce_dim=reduce_dim, tile=tile if recipe == "blockwise" else None)


def _reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: str, grad_fmt: str):
    """y, grad_x, grad_w of ``x @ w.T`` with every GEMM operand fake-quantized, written out by hand."""
    y = _fq(x, recipe, "e4m3", -1, (1, 128)) @ _fq(w, recipe, "e4m3", -1, (128, 128)).t()
    grad_x = _fq(dy, recipe, grad_fmt, -1, (1, 128)) @ _fq(w, recipe, "e4m3", -2, (128, 128))
    grad_w = _fq(dy.t(), recipe, grad_fmt, -1, (1, 128)) @ _fq(x, recipe, "e4m3", -2, (1, 128))
    return y, grad_x, grad_w


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grad_fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(37, 160, 48), (256, 128, 272), (1, 16, 16), (0, 64, 32)])
def test_fp8_linear_equals_fake_quantized_reference(recipe: str, grad_fmt: str, shape: tuple[int, int, int]) -> None:
    M, K, N = shape
    g = torch.Generator().manual_seed(M * 7 + K + N)
    x = torch.randn(M, K, generator=g, requires_grad=True)
    w = (torch.randn(N, K, generator=g) * 0.05).requires_grad_(True)
    dy = torch.randn(M, N, generator=g)
    opts = Fp8Options(recipe, grad_fmt, False, "emulate", False)
    y = fp8_linear(x, w, opts)
    y.backward(dy)
    ref_y, ref_gx, ref_gw = _reference(x.detach(), w.detach(), dy, recipe, grad_fmt)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-5, atol=1e-6)


def test_fp8_linear_is_close_to_the_unquantized_product() -> None:
    """e4m3 keeps 3 mantissa bits: about 4 % relative error on random data, never more than 6 %."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 256, generator=g), torch.randn(64, 256, generator=g)
    for recipe in RECIPES:
        y = fp8_linear(x, w, Fp8Options(recipe, "e4m3", False, "emulate", False))
        exact = x @ w.t()
        assert float((y - exact).norm() / exact.norm()) < 0.06, recipe


def test_fp8_linear_leading_dims_and_nonfinite() -> None:
    opts = Fp8Options("blockwise", "e4m3", False, "emulate", False)
    x = torch.randn(2, 3, 128)
    w = torch.randn(32, 128)
    assert fp8_linear(x, w, opts).shape == (2, 3, 32)
    x[0, 1, 5] = float("inf")
    y = fp8_linear(x, w, opts)
    assert torch.isnan(y[0, 1]).all() and torch.isfinite(y[0, 0]).all()  # only the row with inf is lost


def _tiny(fp8_dense: str = "on", **fp8: object) -> TransformerConfig:
    moe = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2, shared_expert_ffn_size=32,
                    shared_expert_gate=True, fp8=Fp8Config(backend="emulate", **fp8))  # fmt: skip
    return TransformerConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, moe=moe,
                             num_dense_layers=1, dense_ffn_hidden_size=64, fp8_dense=fp8_dense)  # fmt: skip


def test_model_switch_converts_dense_linears_only() -> None:
    model = MoETransformer(_tiny())
    converted = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert "layers.0.attn.q_proj" in converted and "layers.0.ffn.down_proj" in converted
    assert "layers.1.ffn.shared_expert.gate_up" in converted
    assert not any("lm_head" in n or "router" in n for n in converted)
    assert "layers.1.ffn.shared_expert.gate" not in converted  # one-output gate stays
    plain = MoETransformer(_tiny("off"))
    assert plain.state_dict().keys() == model.state_dict().keys()  # same checkpoint format
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())


def test_model_switch_forward_backward_matches_reference_layer() -> None:
    """A converted model's q_proj computes exactly fp8_linear (and differs from the bf16 product)."""
    torch.manual_seed(0)
    model = MoETransformer(_tiny(recipe="rowwise"))
    x = torch.randn(5, 64)
    q = model.layers[0].attn.q_proj
    ref = fp8_linear(x, q.weight, Fp8Options("rowwise", "e4m3", False, "emulate", False))
    torch.testing.assert_close(q(x), ref)
    assert not torch.allclose(q(x), x @ q.weight.t())
    logits = model(torch.randint(0, 96, (2, 16)))
    logits.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_fp8_dense_needs_the_experts_recipe_and_a_known_mode() -> None:
    moe = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="moe.fp8"):
        TransformerConfig(vocab_size=96, hidden_size=64, num_layers=1, num_heads=4, moe=moe, fp8_dense="on")
    with pytest.raises(ValueError, match="fp8_dense='fast' is unknown"):
        _tiny("fast")


def test_fp8_on_cpu_without_emulation_is_refused_at_the_first_call() -> None:
    layer = nn.Linear(64, 32, bias=False)
    convert_linears_to_fp8(nn.Sequential(layer), "on", Fp8Config(backend="auto"))
    assert isinstance(layer, Fp8Linear)
    with pytest.raises(ValueError, match="emulat"):
        layer(torch.randn(4, 64))
    auto = nn.Linear(64, 32, bias=False)
    convert_linears_to_fp8(nn.Sequential(auto), "on", Fp8Config(backend="auto", enabled="auto"))
    torch.testing.assert_close(auto(torch.ones(2, 64)), torch.ones(2, 64) @ auto.weight.t())  # auto: plain linear


def test_torchao_mode_is_refused_with_the_reason_where_it_cannot_run() -> None:
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    with pytest.raises(ValueError, match="torchao"):
        convert_linears_to_fp8(model, "torchao", Fp8Config(recipe="rowwise"), "cpu")


def test_eligible_linears_skip_odd_sizes_and_biases() -> None:
    model = nn.ModuleDict(
        {"a": nn.Linear(64, 48, bias=False), "b": nn.Linear(64, 40, bias=False), "c": nn.Linear(64, 48)}
    )
    assert [n for n, _ in eligible_linears(model)] == ["a"]  # 40 is not a multiple of 16; c has a bias
