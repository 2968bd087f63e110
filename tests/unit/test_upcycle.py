"""Sparse upcycling: the upcycled layer/model equals the dense one at initialisation."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import DenseMLP, MoETransformer, TransformerConfig
from lightning_moe.models.upcycle import topk_weight_sum_at_uniform, upcycle_mlp, upcycle_model
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import find_moe_layers


def _mlp(hidden: int = 32, ffn: int = 48) -> DenseMLP:
    torch.manual_seed(0)
    return DenseMLP(hidden, ffn)


def _x(hidden: int = 32) -> torch.Tensor:
    return torch.randn(3, 10, hidden, generator=torch.Generator().manual_seed(2))


ROUTINGS: list[dict[str, Any]] = [
    {},  # softmax over the K selected logits
    {"pre_softmax": True, "norm_topk_prob": True},
    {"pre_softmax": True, "norm_topk_prob": False},  # s = K/E, compensated
    {"score_func": "sigmoid", "norm_topk_prob": True},
    {"score_func": "sigmoid", "norm_topk_prob": False},  # s = K/2, compensated
    {"score_func": "sigmoid", "scaling_factor": 2.5, "expert_bias": True, "num_groups": 4, "group_topk": 2, "top_k": 4},
    {"shared_expert_ffn_size": 16, "shared_expert_gate": True},  # shared expert starts silent
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()) or "default")
def test_upcycled_layer_equals_dense_mlp_with_uniform_router(routing: dict[str, Any]) -> None:
    mlp = _mlp()
    kwargs = {"top_k": 2, **routing}
    layer = upcycle_mlp(mlp, 8, experts_backend="loop", aux_loss="none", **kwargs)
    x = _x()
    torch.testing.assert_close(layer(x), mlp(x), atol=1e-6, rtol=1e-5)


def test_identical_experts_match_dense_for_any_router_when_weights_sum_to_one() -> None:
    mlp = _mlp()
    layer = upcycle_mlp(mlp, 8, 2, router_init="normal", router_std=1.0, generator=torch.Generator().manual_seed(0))
    assert layer.router.weight.abs().sum() > 0
    x = _x()
    torch.testing.assert_close(layer.eval()(x), mlp(x), atol=1e-6, rtol=1e-5)


def test_noise_perturbs_each_expert_differently_and_relative_to_weight_scale() -> None:
    mlp = _mlp()
    layer = upcycle_mlp(mlp, 4, 2, noise_std=0.1, generator=torch.Generator().manual_seed(0))
    w13 = layer.experts.w13.detach()
    base = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t().detach()
    deltas = w13 - base
    assert not torch.equal(deltas[0], deltas[1])
    ratio = float(deltas.std() / base.std())
    assert 0.07 < ratio < 0.13


def test_upcycle_keeps_dense_dtype_and_leaves_dense_unchanged() -> None:
    mlp = _mlp().to(torch.bfloat16)
    before = copy.deepcopy(mlp.state_dict())
    layer = upcycle_mlp(mlp, 4, 2)
    assert layer.experts.w13.dtype == torch.bfloat16
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())


def test_topk_weight_sum_at_uniform_hand_values() -> None:
    def cfg(**kw: Any) -> MoEConfig:
        return MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=2, **kw)

    assert topk_weight_sum_at_uniform(cfg()) == 1.0
    assert topk_weight_sum_at_uniform(cfg(pre_softmax=True, norm_topk_prob=False)) == 0.25
    assert topk_weight_sum_at_uniform(cfg(score_func="sigmoid", norm_topk_prob=False)) == 1.0
    assert topk_weight_sum_at_uniform(cfg(score_func="sigmoid", scaling_factor=2.5)) == 2.5


def test_upcycle_model_turns_transformer_dense_layers_into_moe_and_keeps_logits() -> None:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss="none")
    cfg = TransformerConfig(
        vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, moe=moe, num_dense_layers=2, dense_ffn_hidden_size=48
    )
    torch.manual_seed(0)
    model = MoETransformer(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    expected = model(ids)
    upcycle_model(model, 8, 2, seed=0, experts_backend="loop", aux_loss="none")
    layers = find_moe_layers(model)
    assert [n for n, _ in layers] == ["layers.0.ffn", "layers.1.ffn", "layers.2.ffn"]
    assert layers[0][1].config.num_experts == 8
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)


def test_upcycle_model_upcycles_hf_dense_model() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    expected = model(input_ids=ids).logits
    upcycle_model(model, 4, 2, experts_backend="loop")
    assert len(find_moe_layers(model)) == 2
    torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_upcycle_rejects_non_swiglu_module() -> None:
    with pytest.raises(ValueError, match="Linear has no gate_proj/up_proj/down_proj"):
        upcycle_mlp(nn.Linear(4, 4), 4, 2)


def test_upcycle_rejects_negative_noise() -> None:
    with pytest.raises(ValueError, match="noise_std=-0.1 must be >= 0"):
        upcycle_mlp(_mlp(), 4, 2, noise_std=-0.1)


def test_upcycle_model_without_dense_mlp_raises() -> None:
    with pytest.raises(ValueError, match="no dense SwiGLU MLP found in Sequential"):
        upcycle_model(nn.Sequential(nn.Linear(4, 4)), 4, 2)


def test_upcycle_model_skips_existing_moe_layers() -> None:
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, top_k=1, pre_softmax=True))
    model = nn.ModuleDict({"moe": layer, "mlp": DenseMLP(8, 16)})
    upcycle_model(model, 4, 2)
    assert model["moe"] is layer and isinstance(model["mlp"], MoELayer)


def test_normal_router_init_draws_from_the_generator_scaled_by_router_std() -> None:
    layer = upcycle_mlp(_mlp(), 8, 2, router_init="normal", router_std=0.05, generator=torch.Generator().manual_seed(4))
    expected = torch.randn(8, 32, generator=torch.Generator().manual_seed(4)) * 0.05  # [E, H]; no noise drawn first
    torch.testing.assert_close(layer.router.weight.detach(), expected, atol=0, rtol=0)


def test_match_output_false_copies_down_projection_unscaled_and_output_is_k_over_e_times_dense() -> None:
    mlp = _mlp()
    # pre_softmax without renormalisation: s = K/E = 2/8 at the uniform (zero) router.
    layer = upcycle_mlp(
        mlp, 8, 2, match_output=False, pre_softmax=True, norm_topk_prob=False, experts_backend="loop", aux_loss="none"
    )
    w2_expected = mlp.down_proj.weight.detach().t().expand(8, -1, -1)
    torch.testing.assert_close(layer.experts.w2.detach(), w2_expected, atol=0, rtol=0)
    x = _x()
    torch.testing.assert_close(layer(x), mlp(x) * (2 / 8), atol=1e-6, rtol=1e-5)


def test_upcycled_experts_are_marked_so_expert_seeding_keeps_them() -> None:
    """``init_experts_by_id`` (a strategy's ``expert_init_seed``) skips experts marked ``seeded_or_loaded``."""
    layer = upcycle_mlp(_mlp(), 4, 2)
    assert layer.experts.seeded_or_loaded
    assert not MoELayer(layer.config).experts.seeded_or_loaded
