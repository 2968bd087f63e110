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


def test_swap_scores_deepseek_groups_by_top2_when_top_k_is_not_twice_topk_group() -> None:
    cfg = _deepseek_v3()
    cfg.num_experts_per_tok, cfg.topk_group = 2, 2  # HF scores groups by top-2, top_k/topk_group is 1
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch")
    assert {m.config.group_score_topk for _, m in find_moe_layers(ours)} == {2}
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, atol=1e-5, rtol=1e-5)


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


def test_swap_rejects_deepseek_single_expert_with_renormalisation() -> None:
    cfg = _deepseek_v3()
    cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob = 1, 1, 1, True
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with norm_topk_prob=True"):
        swap_moe_blocks(model)


def test_swap_rejects_non_silu_experts_naming_the_activation() -> None:
    cfg = _qwen3()
    cfg.hidden_act = "gelu"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="hidden_act='gelu'; MoELayer experts are SwiGLU"):
        swap_moe_blocks(model)


# ---- transformers 4.x layout: one MLP module per expert (w1 gate, w3 up, w2 down) ---------------


class _ExpertMLP4x(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """transformers 4.x Mixtral block, written out: softmax over E, top-k, renormalised, ModuleList experts."""

    def __init__(self, hidden: int = 16, ffn: int = 12, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.jitter_noise = 0.0
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(_ExpertMLP4x(hidden, ffn) for _ in range(num_experts))

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.gate(x_TH)
        weights_TK, ids_TK = logits_TE.float().softmax(-1).topk(self.top_k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(-1, keepdim=True)).to(x_TH.dtype)
        y_TH = torch.zeros_like(x_TH)
        for t in range(x_TH.shape[0]):
            for k in range(self.top_k):
                y_TH[t] += weights_TK[t, k] * self.experts[int(ids_TK[t, k])](x_TH[t])
        return y_TH.view_as(x_BSH), logits_TE


def _block_4x() -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.moe = MixtralSparseMoeBlock()
    with torch.no_grad():
        for p in holder.parameters():
            p.normal_(std=0.3)
    return holder


def test_swap_of_per_expert_module_list_keeps_gate_and_up_apart_and_the_output() -> None:
    ref = _block_4x()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="loop")
    layer = ours.moe
    assert isinstance(layer, HFMoELayer) and layer.returns_router_logits
    F = layer.config.ffn_hidden_size
    for e, mlp in enumerate(ref.moe.experts):
        assert torch.equal(layer.experts.w13[e, :, :F], mlp.w1.weight.t())  # gate columns first
        assert torch.equal(layer.experts.w13[e, :, F:], mlp.w3.weight.t())
        assert torch.equal(layer.experts.w2[e], mlp.w2.weight.t())
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    y, logits = layer(x)
    y_ref, logits_ref = ref.moe(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=1e-6)


def test_export_of_per_expert_module_list_writes_trained_gate_and_up_back_to_w1_and_w3() -> None:
    model = swap_moe_blocks(_block_4x())
    with torch.no_grad():
        F = model.moe.config.ffn_hidden_size
        model.moe.experts.w13[:, :, :F].fill_(1.0)  # "trained" gate columns
        model.moe.experts.w13[:, :, F:].fill_(-2.0)  # "trained" up columns
    export_moe_blocks(model)
    for mlp in model.moe.experts:
        assert torch.equal(mlp.w1.weight, torch.ones_like(mlp.w1.weight))
        assert torch.equal(mlp.w3.weight, torch.full_like(mlp.w3.weight, -2.0))
