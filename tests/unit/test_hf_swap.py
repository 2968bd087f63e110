"""Model-level swap of HF MoE blocks: same logits, same gradients, exact round trip.

Tiny random configs of Qwen3-MoE, Qwen2-MoE (gated shared expert), Mixtral and DeepSeek-V3
(group-limited sigmoid routing, correction bias, scaling factor, shared experts, a dense first
layer) are built in the test; nothing is downloaded. Block-level parity lives in
``test_hf_parity.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf import HFMoELayer, export_moe_blocks, swap_moe_blocks
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import find_moe_layers

VOCAB = 96


def _qwen3() -> Any:
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip


def _qwen3_unnormalised() -> Any:
    cfg = _qwen3()
    cfg.norm_topk_prob = False
    return cfg


def _qwen2() -> Any:
    return transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip


def _mixtral() -> Any:
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip


def _deepseek_v3() -> Any:
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip


CONFIGS = {
    "qwen3_moe": (_qwen3, 2),
    "qwen3_moe_unnormalised": (_qwen3_unnormalised, 2),
    "qwen2_moe": (_qwen2, 2),
    "mixtral": (_mixtral, 2),
    "deepseek_v3": (_deepseek_v3, 2),  # 3 layers, the first dense
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name][0]()).float()
    with torch.no_grad():
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)  # non-zero, so a wrong bias mapping changes the routing
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_swap_keeps_logits_and_gradients(name: str) -> None:
    ref = _model(name).train()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch").train()
    assert len(find_moe_layers(ours)) == CONFIGS[name][1]
    assert all(isinstance(m, HFMoELayer) for _, m in find_moe_layers(ours))
    ids = _ids()

    ref_out = ref(input_ids=ids, labels=ids)
    our_out = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(our_out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    ref_out.loss.backward()
    our_out.loss.backward()

    our_params = dict(ours.named_parameters())
    for pname, p in ref.named_parameters():
        if ".mlp.experts." in pname or ".mlp.gate." in pname or ".shared_expert" in pname:
            continue  # compared below, in our layout
        torch.testing.assert_close(our_params[pname].grad, p.grad, atol=1e-5, rtol=1e-4, msg=pname)
    for lname, layer in find_moe_layers(ours):
        block = ref.get_submodule(lname)
        torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            layer.experts.w13.grad, block.experts.gate_up_proj.grad.transpose(1, 2), atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            layer.experts.w2.grad, block.experts.down_proj.grad.transpose(1, 2), atol=1e-5, rtol=1e-4
        )
        shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
        if shared is not None:
            gate_up_grad = torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])
            torch.testing.assert_close(layer.shared_expert.gate_up.weight.grad, gate_up_grad, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                layer.shared_expert.down.weight.grad, shared.down_proj.weight.grad, atol=1e-5, rtol=1e-4
            )
        if hasattr(block, "shared_expert_gate"):
            torch.testing.assert_close(
                layer.shared_expert.gate.weight.grad, block.shared_expert_gate.weight.grad, atol=1e-5, rtol=1e-4
            )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_swap_then_export_restores_state_dict_bitwise(name: str) -> None:
    model = _model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {k: type(m) for k, m in model.named_modules()}
    export_moe_blocks(swap_moe_blocks(model))
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype, key
        assert torch.equal(after[key], value), key
    assert {k: type(m) for k, m in model.named_modules()} == classes
    # and the exported model still runs
    model(input_ids=_ids())


def test_export_carries_trained_weights_into_hf_layout() -> None:
    model = swap_moe_blocks(_model("deepseek_v3"))
    lname, layer = find_moe_layers(model)[0]
    with torch.no_grad():
        layer.experts.w13.add_(1.0)
        layer.router.expert_bias.fill_(0.25)
        layer.shared_expert.gate_up.weight.mul_(2.0)
    expected_logits = model(input_ids=_ids()).logits
    w13 = layer.experts.w13.detach().clone()
    export_moe_blocks(model)
    block = model.get_submodule(lname)
    assert torch.equal(block.experts.gate_up_proj, w13.transpose(1, 2))
    assert torch.equal(block.gate.e_score_correction_bias, torch.full_like(block.gate.e_score_correction_bias, 0.25))
    torch.testing.assert_close(model(input_ids=_ids()).logits, expected_logits, atol=1e-5, rtol=1e-5)


def test_swap_turns_off_hf_router_logits_and_uses_our_aux_loss() -> None:
    cfg = _qwen3()
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.02
    model = swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(cfg))
    assert model.config.output_router_logits is False
    layer = find_moe_layers(model)[0][1]
    assert (layer.config.aux_loss, layer.config.aux_loss_coeff) == ("switch", 0.02)
    model.train()(input_ids=_ids(), labels=_ids()).loss.backward()
    assert "load_balancing_loss" in layer.last_aux_losses
    export_moe_blocks(model)
    assert model.config.output_router_logits is True


def test_swap_overrides_reach_every_layer() -> None:
    model = swap_moe_blocks(_model("qwen3_moe"), aux_loss="seq", experts_backend="loop")
    assert {(m.config.aux_loss, m.config.experts_backend) for _, m in find_moe_layers(model)} == {("seq", "loop")}


def test_swap_rejects_unknown_override() -> None:
    with pytest.raises(ValueError, match=r"unknown MoEConfig fields \['not_a_field'\]"):
        swap_moe_blocks(_model("qwen3_moe"), not_a_field=1)


def test_swap_rejects_model_without_moe_blocks() -> None:
    with pytest.raises(ValueError, match="no supported MoE block in Sequential"):
        swap_moe_blocks(nn.Sequential(nn.Linear(4, 4)))


def test_swap_rejects_deepseek_groups_not_scored_by_top2() -> None:
    cfg = _deepseek_v3()
    cfg.num_experts_per_tok, cfg.topk_group = 2, 2  # HF scores groups by top-2, we would use top-1
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="num_experts_per_tok=2, topk_group=2"):
        swap_moe_blocks(model)


def test_export_rejects_routing_override_hf_cannot_hold() -> None:
    model = swap_moe_blocks(_model("qwen3_moe"), expert_bias=True)
    with pytest.raises(ValueError, match="routing overrides \\{'expert_bias': True\\}"):
        export_moe_blocks(model)


def test_export_without_swap_raises() -> None:
    with pytest.raises(ValueError, match="call swap_moe_blocks"):
        export_moe_blocks(_model("mixtral"))


def test_swapped_layers_are_moe_layers_with_hf_dtype() -> None:
    model = _model("mixtral").to(torch.bfloat16)
    swap_moe_blocks(model)
    layer = find_moe_layers(model)[0][1]
    assert isinstance(layer, MoELayer)
    assert layer.experts.w13.dtype == torch.bfloat16 and layer.router.weight.dtype == torch.bfloat16
    out = model(input_ids=_ids()).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
