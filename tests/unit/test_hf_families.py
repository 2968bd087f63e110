"""Every HF MoE family in ``swap_moe_blocks``: same logits and gradients, exact round trip, clear refusals.

Tiny random fp32 configs of GLM-4-MoE, OLMoE, dots1, ERNIE-4.5-MoE, HunYuan-MoE, Granite-MoE,
DeepSeek-V2 (greedy and group-limited), Qwen3-Next, Qwen3.5-MoE, MiniMax, Llama 4 (the
routing weight scales the expert input) and gpt-oss (router and expert biases, interleaved
gate/up, clamped SwiGLU; its attention sinks and sliding window stay HF's) are built here
(nothing is downloaded); correction biases, router and expert biases are randomised so a wrong
bias mapping changes the result, and gpt-oss's ``swiglu_limit`` is set low enough that the clamp
is active on these inputs. PhiMoE is refused with the reason. The families of
``test_hf_swap.py`` (Qwen3, Qwen2, Mixtral, DeepSeek-V3) are not repeated.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf import SUPPORTED_BLOCKS, HFMoELayer, export_moe_blocks, swap_moe_blocks  # noqa: E402
from lightning_moe.models.hf_families import FAMILIES, family_of  # noqa: E402
from lightning_moe.moe.utils import find_moe_layers  # noqa: E402

VOCAB = 96
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, eos_token_id=1, bos_token_id=0, pad_token_id=2)  # fmt: skip
_V3_LIKE = dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1,
                num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                num_hidden_layers=3)  # fmt: skip
_V2 = dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, routed_scaling_factor=1.5, first_k_dense_replace=1, num_hidden_layers=3,
           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           num_key_value_heads=4)  # fmt: skip
_LINEAR_ATTN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    full_attention_interval=2)  # fmt: skip

# name -> (model_type, config kwargs, number of MoE layers)
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    "glm4_moe": ("glm4_moe", _V3_LIKE, 2),
    "olmoe": ("olmoe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), 2),
    "olmoe_unnormalised": ("olmoe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2), 2),
    "dots1": ("dots1", _V3_LIKE, 2),
    "ernie4_5_moe": ("ernie4_5_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                          num_experts_per_tok=2, moe_num_shared_experts=1, moe_layer_start_index=0,
                                          moe_layer_interval=1), 2),
    "ernie4_5_moe_unshared": ("ernie4_5_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                                   num_experts_per_tok=3, moe_num_shared_experts=0,
                                                   moe_layer_start_index=1, moe_layer_interval=1), 1),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(intermediate_size=16, num_experts=8, moe_topk=2), 2),
    "granitemoe": ("granitemoe", dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2), 2),
    "deepseek_v2": ("deepseek_v2", _V2, 2),
    "deepseek_v2_grouped": ("deepseek_v2", dict(_V2, topk_method="group_limited_greedy", n_group=4, topk_group=2), 2),
    # groups scored by their best expert while each kept group gives top_k/topk_group = 2 (group_score_topk=1)
    "deepseek_v2_grouped_k4": ("deepseek_v2", dict(_V2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                   num_experts_per_tok=4), 2),
    # groups scored by their top-2 while top_k/topk_group = 1 (group_score_topk=2)
    "dots1_top2_groups": ("dots1", dict(_V3_LIKE, num_experts_per_tok=2, topk_group=2), 2),
    "qwen3_next": ("qwen3_next", dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **_LINEAR_ATTN), 2),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                             num_experts=8, num_experts_per_tok=2, **_LINEAR_ATTN), 2),
    "llama4": ("llama4_text", dict(intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4,
                                   num_experts_per_tok=1, interleave_moe_layer_step=1), 2),
    "llama4_top2": ("llama4_text", dict(intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4,
                                        num_experts_per_tok=2, interleave_moe_layer_step=1), 2),
    "minimax": ("minimax", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                layer_types=["linear_attention", "full_attention"], block_size=8), 2),
    # swiglu_limit 0.15: about 12 % of the gate and 20 % of the up values are clamped on these inputs
    "gpt_oss": ("gpt_oss", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                swiglu_limit=0.15), 2),
    "gpt_oss_top3": ("gpt_oss", dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
                                     sliding_window=8, swiglu_limit=0.15, swiglu_alpha=1.2), 2),
}  # fmt: skip
_RANDOM_BIASES = ("e_score_correction_bias", "router.bias", "gate_up_proj_bias", "down_proj_bias")


def hf_config(name: str, **changes: Any) -> Any:
    model_type, kwargs, _ = CONFIGS[name]
    return transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs, **changes})


def hf_model(name: str, **changes: Any) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **changes)).float()
    with torch.no_grad():
        for tensor_name, t in [*model.named_buffers(), *model.named_parameters()]:
            if tensor_name.endswith(_RANDOM_BIASES):
                t.normal_(0.0, 0.05)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _gate_columns_first(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) if interleaved else t


def _hf_grads_in_our_layout(block: nn.Module) -> dict[str, torch.Tensor]:
    """The HF block's gradients under our parameter names (w13 = gate_up^T, gate columns first;
    shared gate_up = cat)."""
    fam = family_of(block)
    assert fam is not None
    gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    router = block.get_submodule(fam.router)
    out = {
        "router.weight": router.weight.grad,
        "experts.w13": _gate_columns_first(gate_up if fam.experts_transposed else gate_up.transpose(1, 2),
                                           fam.gate_up_interleaved),
        "experts.w2": down if fam.experts_transposed else down.transpose(1, 2),
    }  # fmt: skip
    if getattr(router, "bias", None) is not None:
        out["router.bias"] = router.bias.grad
    if getattr(block.experts, "gate_up_proj_bias", None) is not None:
        out["experts.b13"] = _gate_columns_first(block.experts.gate_up_proj_bias.grad, fam.gate_up_interleaved)
        out["experts.b2"] = block.experts.down_proj_bias.grad
    shared = getattr(block, fam.shared, None) if fam.shared else None
    if shared is not None:
        out["shared_expert.gate_up.weight"] = torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])
        out["shared_expert.down.weight"] = shared.down_proj.weight.grad
    if fam.shared_gate:
        out["shared_expert.gate.weight"] = getattr(block, fam.shared_gate).weight.grad
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_swap_keeps_logits_and_gradients(name: str) -> None:
    ref = hf_model(name).train()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch").train()
    layers = find_moe_layers(ours)
    assert len(layers) == CONFIGS[name][2]
    assert all(isinstance(m, HFMoELayer) and m.family == family_of(ref.get_submodule(n)).name for n, m in layers)
    ids = _ids()

    ref_out, our_out = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(our_out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    ref_out.loss.backward()
    our_out.loss.backward()
    moe_prefixes = tuple(f"{n}." for n, _ in layers)
    our_params = dict(ours.named_parameters())
    for pname, p in ref.named_parameters():
        if pname.startswith(moe_prefixes) or not p.requires_grad:
            continue
        torch.testing.assert_close(our_params[pname].grad, p.grad, atol=1e-5, rtol=1e-5, msg=pname)
    for lname, layer in layers:
        want = _hf_grads_in_our_layout(ref.get_submodule(lname))
        got = {k: p.grad for k, p in layer.named_parameters()}
        assert sorted(got) == sorted(want), lname
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, atol=1e-5, rtol=1e-5, msg=f"{lname}.{key}")

    with torch.no_grad():  # eval mode too (no jitter, no bias counting)
        torch.testing.assert_close(ours.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_swap_then_export_restores_state_dict_bitwise(name: str) -> None:
    model = hf_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {k: type(m) for k, m in model.named_modules()}
    swap_moe_blocks(model)
    assert len(find_moe_layers(model)) == CONFIGS[name][2]
    export_moe_blocks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert {k: type(m) for k, m in model.named_modules()} == classes


def test_export_carries_a_trained_ernie_bias_into_its_two_dimensional_parameter() -> None:
    model = swap_moe_blocks(hf_model("ernie4_5_moe"))
    lname, layer = find_moe_layers(model)[0]
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, layer.config.num_experts))
        layer.router.weight.mul_(3.0)
    expected = model(input_ids=_ids()).logits
    export_moe_blocks(model)
    bias = model.get_submodule(lname).gate.moe_statics.e_score_correction_bias
    assert bias.shape == (1, 8) and torch.equal(bias[0], torch.linspace(-0.5, 0.5, 8))
    torch.testing.assert_close(model(input_ids=_ids()).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "changes", "routing"),
    [
        ("hunyuan_v1_moe", {}, {"score_func": "softmax", "pre_softmax": True, "norm_topk_prob": True}),
        ("granitemoe", {}, {"score_func": "softmax", "pre_softmax": False}),
        ("ernie4_5_moe", {}, {"pre_softmax": True, "norm_topk_prob": True, "expert_bias": True}),
        ("deepseek_v2", {}, {"norm_topk_prob": False, "scaling_factor": 1.5, "num_groups": None}),
        ("deepseek_v2_grouped", {}, {"num_groups": 4, "group_topk": 2, "group_score_topk": 1, "scaling_factor": 1.5}),
        ("glm4_moe", {}, {"score_func": "sigmoid", "num_groups": 4, "group_topk": 2, "group_score_topk": 2,
                          "expert_bias": True}),
        ("glm4_moe", {"topk_group": 4, "num_experts_per_tok": 3}, {"num_groups": None, "top_k": 3}),  # all groups kept
        ("qwen3_5_moe", {}, {"norm_topk_prob": True, "shared_expert_gate": True, "shared_expert_ffn_size": 24}),
    ],
    ids=["hunyuan", "granite", "ernie", "v2_greedy", "v2_grouped", "glm4", "glm4_all_groups", "qwen3_5"],
)
def test_swapped_layers_carry_the_family_routing(name: str, changes: dict, routing: dict) -> None:
    layer = find_moe_layers(swap_moe_blocks(hf_model(name, **changes)))[0][1]
    assert {k: getattr(layer.config, k) for k in routing} == routing


def test_minimax_input_jitter_is_kept() -> None:
    layer = find_moe_layers(swap_moe_blocks(hf_model("minimax", router_jitter_noise=0.1)))[0][1]
    assert layer.jitter_noise == 0.1


# ---- refusals ---------------------------------------------------------------------------------


def _refused_model(model_type: str, **kwargs: Any) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs})
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize(
    ("model_type", "kwargs", "match"),
    [
        ("phimoe", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2), r"PhimoeSparseMoeBlock.*SparseMixer"),
    ],
    ids=["phimoe"],
)  # fmt: skip
def test_refused_families_name_the_block_and_the_reason(model_type: str, kwargs: dict, match: str) -> None:
    model = _refused_model(model_type, **kwargs)
    with pytest.raises(ValueError, match=rf"{match}.*Leave this model unswapped"):
        swap_moe_blocks(model)


@pytest.mark.parametrize(
    ("name", "changes", "match"),
    [
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
        ("deepseek_v2", dict(mlp_bias=True), "shared expert of .* has biases"),
        ("hunyuan_v1_moe", dict(moe_topk=1), "num_experts_per_tok=1 with renormalisation"),
        ("olmoe", dict(num_experts_per_tok=1, norm_topk_prob=True), "num_experts_per_tok=1 with renormalisation"),
        ("granitemoe", dict(num_experts_per_tok=1), "softmax over one selected logit"),
        ("olmoe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
    ids=["v2_topk_method", "v2_mlp_bias", "hunyuan_top1", "olmoe_top1", "granite_top1", "gelu"],
)  # fmt: skip
def test_inexpressible_configs_are_refused(name: str, changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        swap_moe_blocks(hf_model(name, **changes))


def test_top1_without_renormalisation_swaps_exactly() -> None:
    ref = hf_model("olmoe_unnormalised", num_experts_per_tok=1).eval()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, atol=1e-5, rtol=1e-5)


def test_family_table_names_classes_of_this_transformers() -> None:
    import importlib

    for block, fam in FAMILIES.items():
        module = importlib.import_module(f"transformers.models.{fam.name}.modeling_{fam.name}")
        assert hasattr(module, block), (fam.name, block)
    assert set(SUPPORTED_BLOCKS) == {b for b, f in FAMILIES.items() if f.refused is None}
    assert "PhimoeSparseMoeBlock" not in SUPPORTED_BLOCKS and "GptOssMLP" in SUPPORTED_BLOCKS


# ---- group_score_topk: a group's score from its best `group_score_topk` experts -----------------


def _reference_group_topk(scores_TE: torch.Tensor, top_k: int, groups: int, keep: int, per_group: int) -> torch.Tensor:
    """Plain loops: score each group by the sum of its best ``per_group`` scores, keep the best ``keep``."""
    T, E = scores_TE.shape
    size = E // groups
    out = []
    for t in range(T):
        group_score = [sorted(scores_TE[t, g * size : (g + 1) * size].tolist(), reverse=True)[:per_group]
                       for g in range(groups)]  # fmt: skip
        kept = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:keep]
        allowed = [e for e in range(E) if e // size in kept]
        out.append(sorted(sorted(allowed, key=lambda e: -float(scores_TE[t, e]))[:top_k]))
    return torch.tensor(out)


@pytest.mark.parametrize(("top_k", "keep", "per_group"), [(4, 2, 1), (2, 2, 2), (3, 2, 3), (4, 2, None)])
def test_select_topk_scores_groups_by_group_score_topk(top_k: int, keep: int, per_group: int | None) -> None:
    from lightning_moe.moe.router import select_topk

    scores_TE = torch.rand(64, 16, generator=torch.Generator().manual_seed(3))
    got = select_topk(scores_TE, top_k, 4, keep, per_group).sort(-1).values
    want = _reference_group_topk(scores_TE, top_k, 4, keep, per_group if per_group is not None else top_k // keep)
    assert torch.equal(got, want)


def test_group_score_topk_changes_the_selection_and_the_router_uses_it() -> None:
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.router import TopKRouter

    torch.manual_seed(0)
    x_TH = torch.randn(256, 16)
    ids = {}
    for per_group in (1, None):  # None: top_k // group_topk = 2
        cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=16, top_k=4, num_groups=4, group_topk=2,
                        group_score_topk=per_group, pre_softmax=True)  # fmt: skip
        router = TopKRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(5)))
        ids[per_group] = router(x_TH).topk_ids_TK.sort(-1).values
        scores_TE = torch.softmax(x_TH @ router.weight.detach().t(), -1)
        want = _reference_group_topk(scores_TE, 4, 4, 2, per_group or 2)
        assert torch.equal(ids[per_group], want)
    assert not torch.equal(ids[1], ids[None])  # the option is not a no-op on these inputs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(group_score_topk=1), "group_score_topk=1 needs group-limited routing"),
        (dict(num_groups=4, group_topk=2, group_score_topk=5), "group_score_topk=5 exceeds the 4 experts"),
        (dict(num_groups=4, group_topk=2, group_score_topk=0), "group_score_topk"),
        (dict(num_groups=4, group_topk=2, group_score_topk=True), "group_score_topk"),
        (dict(num_groups=4, group_topk=4, top_k=3), "or set group_score_topk"),
    ],
    ids=["no_groups", "too_many", "zero", "bool", "divisibility_hint"],
)
def test_group_score_topk_bad_values_are_refused(kwargs: dict, match: str) -> None:
    from lightning_moe.config import MoEConfig

    base = dict(hidden_size=16, ffn_hidden_size=8, num_experts=16, top_k=4)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_group_score_topk_lets_top_k_skip_the_divisibility_rule() -> None:
    from lightning_moe.config import MoEConfig

    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=16, top_k=3, num_groups=4, group_topk=2,
                    group_score_topk=1)  # fmt: skip
    assert cfg.group_score_topk == 1


def test_fused_topk_kernel_arguments_are_withheld_only_for_a_non_default_group_rule() -> None:
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.router import TopKRouter

    def router(per_group: int | None) -> TopKRouter:
        return TopKRouter(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=16, top_k=4, num_groups=4,
                                    group_topk=2, group_score_topk=per_group))  # fmt: skip

    assert router(None)._topk_kernel_args() is not None
    assert router(2)._topk_kernel_args() is not None  # 4 // 2: the kernel's own rule
    assert router(1)._topk_kernel_args() is None


# ---- routing_weight_on_input: y = sum_k expert_k(w_k * x) ------------------------------------


def _reference_weight_on_input(layer: Any, x_TH: torch.Tensor) -> torch.Tensor:
    """Plain loops over tokens and their slots with the layer's own routing and weights."""
    out = layer.router(x_TH)
    w13, w2 = layer.experts.w13, layer.experts.w2
    F = w2.shape[1]
    y = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for k in range(out.topk_ids_TK.shape[1]):
            e = int(out.topk_ids_TK[t, k])
            if e < 0:
                continue
            h = (out.topk_weights_TK[t, k] * x_TH[t]) @ w13[e]
            y[t] = y[t] + (torch.nn.functional.silu(h[:F]) * h[F:]) @ w2[e]
    return y


@pytest.mark.parametrize(
    ("top_k", "capacity_factor", "memory_efficient_permute"),
    [(1, None, True), (2, None, True), (2, None, False), (2, 0.5, True), (3, None, True)],
)
def test_routing_weight_on_input_scales_the_expert_input(top_k, capacity_factor, memory_efficient_permute) -> None:
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.layer import MoELayer

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=12, num_experts=6, top_k=top_k, score_func="sigmoid",
                    norm_topk_prob=False, routing_weight_on_input=True, capacity_factor=capacity_factor,
                    memory_efficient_permute=memory_efficient_permute, aux_loss="none", experts_backend="torch",
                    init_std=0.3)  # fmt: skip
    layer = MoELayer(cfg)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_(True)
    ref_params = copy.deepcopy(layer)
    y_ref = _reference_weight_on_input(ref_params, x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for (n, p), (_, q) in zip(layer.named_parameters(), ref_params.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=n)
    # weighting the output instead is a different function (the option is not a no-op)
    off = MoELayer(dataclasses_replace(cfg, routing_weight_on_input=False))
    off.load_state_dict(layer.state_dict())
    assert not torch.allclose(off(x.detach()), y.detach(), atol=1e-4)


def test_routing_weight_on_input_with_zero_tokens() -> None:
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.layer import MoELayer

    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=1, score_func="sigmoid",
                               norm_topk_prob=False, routing_weight_on_input=True, aux_loss="none",
                               experts_backend="torch"))  # fmt: skip
    x = torch.zeros(0, 8, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)


def test_routing_weight_on_input_refuses_fp8_and_non_bools() -> None:
    from lightning_moe.config import Fp8Config, MoEConfig

    base = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=1, score_func="sigmoid")
    with pytest.raises(ValueError, match="routing_weight_on_input=True with fp8 experts"):
        MoEConfig(**base, routing_weight_on_input=True, fp8=Fp8Config())
    with pytest.raises(TypeError, match="routing_weight_on_input='yes' is not a bool"):
        MoEConfig(**base, routing_weight_on_input="yes")


def dataclasses_replace(cfg: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


# ---- expert-math overrides -------------------------------------------------------------------


def test_bias_overrides_start_from_zero_and_block_the_export() -> None:
    ref = hf_model("olmoe").eval()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch", router_bias=True, expert_mlp_bias=True).eval()
    layer = find_moe_layers(ours)[0][1]
    assert all(not layer.get_parameter(n).any() for n in ("router.bias", "experts.b13", "experts.b2"))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"routing overrides \{'router_bias': True, 'expert_mlp_bias': True\}"):
        export_moe_blocks(ours)


@pytest.mark.parametrize("changes", [dict(expert_mlp_bias=False), dict(router_bias=False), dict(swiglu_limit=None)])
def test_gpt_oss_overrides_change_the_math_and_block_the_export(changes: dict) -> None:
    ref = hf_model("gpt_oss").eval()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch", **changes).eval()
    layer = find_moe_layers(ours)[0][1]
    names = {n for n, _ in layer.named_parameters()}
    assert ("experts.b13" in names) == layer.config.expert_mlp_bias
    assert ("router.bias" in names) == layer.config.router_bias
    with torch.no_grad():
        assert not torch.allclose(ours(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, atol=1e-4)
    with pytest.raises(ValueError, match="routing overrides"):
        export_moe_blocks(ours)
