"""swap_rms_norms: transformers' RMSNorms replaced by one fused kernel, same weights, same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.hf_norms import FusedRMSNorm, hf_rms_norm_reference, swap_rms_norms

TINY = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


def _hf_norm(width: int, eps: float, dtype: torch.dtype) -> nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(width, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, dtype=dtype) * 0.5 + 1.0)
    return norm


def test_reference_is_transformers_formula() -> None:
    torch.manual_seed(0)
    norm = _hf_norm(24, 1e-5, torch.float32)
    x = torch.randn(5, 7, 24)
    torch.testing.assert_close(hf_rms_norm_reference(x, norm.weight, 1e-5), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 48), (0, 8), (4, 3, 2, 128)])
def test_fused_norm_matches_transformers_in_fp32_with_gradients(shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    hf = _hf_norm(shape[-1], 1e-6, torch.float32)
    fused = FusedRMSNorm(nn.Parameter(hf.weight.detach().clone()), hf.variance_epsilon)
    x = torch.randn(shape) * 3.0
    x_hf, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf, y_fused = hf(x_hf), fused(x_fused)
    torch.testing.assert_close(y_fused, y_hf, rtol=1e-5, atol=1e-6)
    dy = torch.randn(shape)
    (y_hf * dy).sum().backward()
    (y_fused * dy).sum().backward()
    torch.testing.assert_close(x_fused.grad, x_hf.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.weight.grad, hf.weight.grad, rtol=1e-5, atol=1e-5)


def test_fused_norm_in_bf16_is_within_one_rounding_of_transformers() -> None:
    torch.manual_seed(2)
    hf = _hf_norm(256, 1e-6, torch.bfloat16)
    fused = FusedRMSNorm(hf.weight, hf.variance_epsilon)
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 2.0
    exact = hf_rms_norm_reference(x.double(), hf.weight.double(), 1e-6)
    y_hf, y_fused = hf(x), fused(x)
    assert y_fused.dtype == torch.bfloat16
    torch.testing.assert_close(y_fused.double(), y_hf.double(), rtol=1.6e-2, atol=1e-2)
    # One rounding (fused) is never further from the exact value than HF's two, on average.
    assert (y_fused.double() - exact).abs().mean() <= (y_hf.double() - exact).abs().mean() * 1.05


def test_mixed_dtypes_keep_transformers_type_promotion() -> None:
    torch.manual_seed(3)
    hf = _hf_norm(32, 1e-6, torch.float32)  # fp32 weight, bf16 input: HF returns fp32
    fused = FusedRMSNorm(hf.weight, hf.variance_epsilon)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    y_hf, y_fused = hf(x), fused(x)
    assert y_fused.dtype == y_hf.dtype == torch.float32
    torch.testing.assert_close(y_fused, y_hf, rtol=0, atol=0)


def test_swap_keeps_weights_keys_and_logits_of_an_hf_model() -> None:
    torch.manual_seed(4)
    config = transformers.AutoConfig.for_model(**TINY)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                p.uniform_(0.5, 1.5)  # ones would hide a weight that is not applied
    ids = torch.randint(0, 64, (2, 9))
    before = model(input_ids=ids).logits
    keys, params = list(model.state_dict()), {n: p for n, p in model.named_parameters()}
    swapped = swap_rms_norms(model)
    # Two hidden-state norms and the q/k norms of each layer, plus the final norm.
    assert len(swapped) == 2 * 4 + 1, swapped
    assert "model.norm" in swapped and "model.layers.0.self_attn.q_norm" in swapped
    assert all(isinstance(model.get_submodule(name), FusedRMSNorm) for name in swapped)
    assert list(model.state_dict()) == keys
    assert all(params[n] is p for n, p in model.named_parameters())  # optimizer state stays valid
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert swap_rms_norms(model) == []  # nothing left to swap


def test_swap_leaves_other_norms_alone() -> None:
    class OnePlusWeightRMSNorm(nn.Module):  # a Gemma-style norm: not transformers' formula
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    model = nn.Sequential(OnePlusWeightRMSNorm(), nn.LayerNorm(8), nn.RMSNorm(8))
    assert swap_rms_norms(model) == []
    assert isinstance(model[0], OnePlusWeightRMSNorm)


def test_lightning_module_fuses_norms_unless_told_not_to() -> None:
    fused = HFMoELanguageModel(hf_config=TINY)
    plain = HFMoELanguageModel(hf_config=TINY, fused_norms=False)
    count = sum(isinstance(m, FusedRMSNorm) for m in fused.modules())
    assert count == 2 * 4 + 1
    assert not any(isinstance(m, FusedRMSNorm) for m in plain.modules())
    assert any(type(m).__name__ == "Qwen3MoeRMSNorm" for m in plain.modules())
