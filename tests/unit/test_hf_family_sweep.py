"""Every HF MoE family of this transformers, swapped or refused, and the family table of the docs.

Each family of :data:`~lightning_moe.models.hf_families.FAMILIES` is built here from its config
class with tiny sizes (fp32, nothing downloaded; correction biases randomised so a wrong bias
mapping changes the result): the swapped model's logits and every gradient equal HF's at 1e-5,
swap then export gives the original state dict bit for bit, and a refused family raises a
``ValueError`` with its reason. The families of ``test_hf_families.py`` and ``test_hf_swap.py``
reuse those files' configs; the others (MiniMax-M2, GLM-4-MoE-Lite, EXAONE-MoE, Kimi-Linear,
AFMoE, LFM2-MoE, Cohere2-MoE, LongCat-Flash, the Granite-MoE variants, Jamba, and the MoE text
decoders of Qwen3-VL-MoE, GLM-4V-MoE and ERNIE-4.5-VL) are configured below. Hybrid models keep
their Mamba / linear-attention / short-convolution layers as HF's; vision towers are not touched.

The table between the markers in ``docs/hf_models.md`` must equal the one this sweep generates;
``LIGHTNING_MOE_WRITE_DOCS=1 python3 -m pytest tests/unit/test_hf_family_sweep.py`` rewrites it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf import HFMoELayer, export_moe_blocks, swap_moe_blocks  # noqa: E402
from lightning_moe.models.hf_families import FAMILIES, Family, family_of  # noqa: E402
from lightning_moe.moe.utils import find_moe_layers  # noqa: E402

import test_hf_families  # noqa: E402
import test_hf_swap  # noqa: E402
from test_hf_families import _BASE, VOCAB, _hf_grads_in_our_layout  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf_models.md"
BEGIN, END = "<!-- family-table:begin -->", "<!-- family-table:end -->"
WRITE_DOCS = os.environ.get("LIGHTNING_MOE_WRITE_DOCS") == "1"

_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
_V3_GROUPS = dict(intermediate_size=64, moe_intermediate_size=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5)  # fmt: skip
_GRANITE = dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])
_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, patch_size=2, spatial_merge_size=1)

# name -> (model_type, config kwargs, number of MoE layers); causal LMs
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    "minimax_m2": ("minimax_m2", dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2), 2),
    "glm4_moe_lite": ("glm4_moe_lite", dict(_V3_GROUPS, num_local_experts=16, n_routed_experts=16, n_shared_experts=1,
                                            first_k_dense_replace=1, num_hidden_layers=3, **_MLA), 2),
    "exaone_moe": ("exaone_moe", dict(_V3_GROUPS, num_experts=16, num_shared_experts=1, first_k_dense_replace=1,
                                      num_hidden_layers=3), 2),
    "kimi_linear": ("kimi_linear", dict(_V3_GROUPS, num_local_experts=16, n_shared_experts=1, first_k_dense_replace=0,
                                        layer_types=["linear_attention", "full_attention"], linear_num_heads=4,
                                        linear_head_dim=8, **_MLA), 2),
    "afmoe": ("afmoe", dict(intermediate_size=64, moe_intermediate_size=16, num_dense_layers=1, num_experts=8,
                            num_experts_per_tok=2, num_shared_experts=1, route_scale=1.7, num_hidden_layers=3), 2),
    "lfm2_moe": ("lfm2_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                  num_dense_layers=1, num_hidden_layers=3, routed_scaling_factor=1.3,
                                  layer_types=["conv", "full_attention", "conv"]), 2),
    "lfm2_moe_unbiased": ("lfm2_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                           num_experts_per_tok=3, num_dense_layers=1, num_hidden_layers=3,
                                           use_expert_bias=False, norm_topk_prob=False,
                                           layer_types=["conv", "full_attention", "conv"]), 2),
    "cohere2_moe": ("cohere2_moe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                                        shared_expert_combination_strategy="sum"), 2),
    "cohere2_moe_sigmoid": ("cohere2_moe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                                expert_selection_fn="sigmoid", norm_topk_prob=True), 2),
    "cohere2_moe_sigmoid_unnormalised": ("cohere2_moe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                                             expert_selection_fn="sigmoid", norm_topk_prob=False), 2),
    "longcat_flash": ("longcat_flash", dict(n_routed_experts=8, zero_expert_num=0, expert_ffn_hidden_size=16,
                                            num_experts_per_tok=2, ffn_hidden_size=32, routed_scaling_factor=1.5,
                                            **_MLA), 1),
    "granitemoeshared": ("granitemoeshared", dict(_GRANITE, shared_intermediate_size=24), 2),
    "granitemoe_swa": ("granitemoe_swa", dict(_GRANITE, sliding_window=8), 2),
    "granitemoehybrid": ("granitemoehybrid", dict(_GRANITE, shared_intermediate_size=24,
                                                  layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                                                  mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8), 2),
    "jamba": ("jamba", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, expert_layer_period=1,
                            expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                            mamba_expand=2, mamba_dt_rank=4), 2),
}  # fmt: skip
# name -> (model_type, config kwargs, number of MoE layers); image-text-to-text models, text-only inputs
VL_CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(
        text_config=dict(_BASE, moe_intermediate_size=16, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                         rope_parameters=_MROPE),
        vision_config=dict(_VISION, out_hidden_size=32, temporal_patch_size=1, deepstack_visual_indexes=[])), 2),
    "glm4v_moe": ("glm4v_moe", dict(
        text_config=dict(_BASE, n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                         rope_parameters=dict(_MROPE, mrope_section=[1, 1, 0], partial_rotary_factor=0.5),
                         **_V3_GROUPS),
        vision_config=dict(_VISION, out_hidden_size=32, temporal_patch_size=1)), 2),
    # the text and the vision experts of its MoE layer (text rows; every other one marked a vision row)
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe", dict(
        text_config=dict(_BASE, moe_intermediate_size=[16, 8], intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, moe_num_shared_experts=1, rope_parameters=_MROPE),
        vision_config=_VISION), 2),
}  # fmt: skip
# family -> (model_type, config kwargs, what the ValueError says)
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "phimoe": ("phimoe", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2), "SparseMixer"),
    "nemotron_h": ("nemotron_h", dict(), "ungated MLPs"),
    "jetmoe": ("jetmoe", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
               "output bias"),
}  # fmt: skip
# family -> the config its table row is built from
TABLE_CONFIG: dict[str, str] = {
    **{n: n for n in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")},
    **{n: n for n in ("glm4_moe", "olmoe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "deepseek_v2",
                      "qwen3_next", "qwen3_5_moe", "minimax", "llama4", "gpt_oss")},
    **{n: n for n in (*CONFIGS, *VL_CONFIGS) if n in {f.name for f in FAMILIES.values()}},
}  # fmt: skip
_RANDOM_BIASES = ("e_score_correction_bias", "expert_bias")


def sweep_model(name: str, **changes: Any) -> nn.Module:
    """The tiny fp32 model of config ``name`` (this file's, ``test_hf_families``' or ``test_hf_swap``'s)."""
    if name in test_hf_swap.CONFIGS:
        return test_hf_swap._model(name)
    if name in test_hf_families.CONFIGS:
        return test_hf_families.hf_model(name, **changes)
    torch.manual_seed(0)
    if name in VL_CONFIGS:
        model_type, kwargs, _ = VL_CONFIGS[name]
        config = transformers.AutoConfig.for_model(model_type, **kwargs, **changes)
        model = transformers.AutoModelForImageTextToText.from_config(config).float()
    else:
        model_type, kwargs, _ = CONFIGS[name]
        config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs, **changes})
        model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for tensor_name, t in [*model.named_buffers(), *model.named_parameters()]:
            if tensor_name.endswith(_RANDOM_BIASES):
                t.normal_(0.0, 0.05)
    return model


def moe_layer_count(name: str) -> int:
    for table in (CONFIGS, VL_CONFIGS, test_hf_families.CONFIGS):
        if name in table:
            return table[name][2]
    return test_hf_swap.CONFIGS[name][1]


def _inputs(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    out = {"input_ids": ids}
    if name == "ernie4_5_vl_moe":  # every other row through the vision experts
        out["moe_mm_token_type_ids"] = (torch.arange(24) % 2).expand(2, 24).clone()
    return out


def check_parity(name: str) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """Swap config ``name``; assert its logits and every gradient equal HF's; return the swapped model."""
    ref = sweep_model(name).train()
    ours = swap_moe_blocks(copy.deepcopy(ref), experts_backend="torch").train()
    layers = find_moe_layers(ours)
    assert len(layers) == moe_layer_count(name), [n for n, _ in layers]
    assert all(isinstance(m, HFMoELayer) and m.family == family_of(ref.get_submodule(n)).name for n, m in layers)
    inputs = _inputs(name)
    labels = inputs["input_ids"]
    ref_out, our_out = ref(**inputs, labels=labels), ours(**inputs, labels=labels)
    torch.testing.assert_close(our_out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    ref_out.loss.backward()
    our_out.loss.backward()
    moe_prefixes = tuple(f"{n}." for n, _ in layers)
    our_params = dict(ours.named_parameters())
    for pname, p in ref.named_parameters():
        if pname.startswith(moe_prefixes) or not p.requires_grad:
            continue
        if p.grad is None:  # a vision tower the text rows never reach
            assert our_params[pname].grad is None, pname
            continue
        torch.testing.assert_close(our_params[pname].grad, p.grad, atol=1e-5, rtol=1e-5, msg=pname)
    for lname, layer in layers:
        want = _hf_grads_in_our_layout(ref.get_submodule(lname))
        got = {k: p.grad for k, p in layer.named_parameters()}
        assert sorted(got) == sorted(want), lname
        for key, grad in want.items():
            assert grad is not None, f"{lname}.{key}: the inputs do not reach this layer"
            torch.testing.assert_close(got[key], grad, atol=1e-5, rtol=1e-5, msg=f"{lname}.{key}")
    with torch.no_grad():  # eval mode too (no jitter, no bias counting)
        torch.testing.assert_close(ours.eval()(**inputs).logits, ref.eval()(**inputs).logits, atol=1e-5, rtol=1e-5)
    return ours, layers


def check_export(name: str) -> None:
    model = sweep_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {k: type(m) for k, m in model.named_modules()}
    swap_moe_blocks(model)
    assert len(find_moe_layers(model)) == moe_layer_count(name)
    export_moe_blocks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert {k: type(m) for k, m in model.named_modules()} == classes


@pytest.mark.parametrize("name", sorted([*CONFIGS, *VL_CONFIGS]))
def test_swap_keeps_logits_and_gradients(name: str) -> None:
    check_parity(name)


@pytest.mark.parametrize("name", sorted([*CONFIGS, *VL_CONFIGS]))
def test_swap_then_export_restores_state_dict_bitwise(name: str) -> None:
    check_export(name)


def _refused_model(family: str) -> nn.Module:
    model_type, kwargs, _ = REFUSED[family]
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_families_name_the_block_and_the_reason(family: str) -> None:
    model = _refused_model(family)
    block = next(type(m).__name__ for m in model.modules() if family_of(m) is not None)
    with pytest.raises(ValueError, match=rf"{block}, {family}\).*{REFUSED[family][2]}.*Leave this model unswapped"):
        swap_moe_blocks(model)


@pytest.mark.parametrize(
    ("name", "changes", "match"),
    [
        ("cohere2_moe", dict(shared_expert_combination_strategy="average"), r"strategy='average'"),
        ("longcat_flash", dict(zero_expert_num=2), r"zero_expert_num=2 zero-computation \(identity\) experts"),
        ("longcat_flash", dict(router_bias=True), r"router_bias=True, a classifier bias .* never adds"),
        ("minimax_m2", dict(num_experts_per_tok=1), r"num_experts_per_tok=1 with norm_topk_prob=True"),
    ],
    ids=["cohere2_average", "longcat_zero_experts", "longcat_router_bias", "minimax_m2_top1"],
)
def test_inexpressible_configs_are_refused_and_leave_the_model_unswapped(name: str, changes: dict, match: str) -> None:
    model_type, kwargs, _ = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config)
    classes = {k: type(m) for k, m in model.named_modules()}
    with pytest.raises(ValueError, match=match):
        swap_moe_blocks(model)
    assert {k: type(m) for k, m in model.named_modules()} == classes


def test_cohere2_without_shared_experts_ignores_the_combination_strategy() -> None:
    """The default strategy is 'average', but with no shared expert HF adds nothing to average."""
    model_type, kwargs, _ = CONFIGS["cohere2_moe"]
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs, "num_shared_experts": 0,
                                                              "shared_expert_combination_strategy": "average"})  # fmt: skip
    layer = find_moe_layers(swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(config)))[0][1]
    assert layer.config.shared_expert_ffn_size is None


@pytest.mark.parametrize(
    ("name", "routing"),
    [
        ("minimax_m2", {"score_func": "sigmoid", "expert_bias": True, "norm_topk_prob": True, "num_groups": None}),
        ("afmoe", {"score_func": "sigmoid", "expert_bias": True, "scaling_factor": 1.7, "shared_expert_ffn_size": 16}),
        ("lfm2_moe_unbiased", {"score_func": "sigmoid", "expert_bias": False, "norm_topk_prob": False}),
        ("cohere2_moe", {"score_func": "softmax", "pre_softmax": False, "shared_expert_ffn_size": 16}),
        ("cohere2_moe_sigmoid", {"score_func": "sigmoid", "norm_topk_prob": True, "expert_bias": False}),
        ("longcat_flash", {"pre_softmax": True, "expert_bias": True, "norm_topk_prob": False, "scaling_factor": 1.5}),
        ("jamba", {"score_func": "softmax", "pre_softmax": True, "norm_topk_prob": False}),
        ("kimi_linear", {"num_groups": 4, "group_topk": 2, "group_score_topk": 2, "scaling_factor": 2.5}),
    ],
)
def test_swapped_layers_carry_the_family_routing(name: str, routing: dict) -> None:
    layer = find_moe_layers(swap_moe_blocks(sweep_model(name)))[0][1]
    assert {k: getattr(layer.config, k) for k in routing} == routing


# ---- the family table of docs/hf_models.md -----------------------------------------------------


def _options(fam: Family, layer: HFMoELayer) -> str:
    """The MoEConfig options (and weight layouts) a swapped layer of ``fam`` uses."""
    c = layer.config
    if c.score_func == "sigmoid":
        out = ["`score_func=sigmoid`"]
    else:
        out = ["softmax over E (`pre_softmax`)" if c.pre_softmax else "softmax over the K selected"]
    if c.score_func == "sigmoid" or c.pre_softmax:
        out.append("`norm_topk_prob`" if c.norm_topk_prob else "not renormalised")
    flags = [
        (c.expert_bias, "`expert_bias`"),
        (c.num_groups is not None, f"group-limited (`group_score_topk={c.group_score_topk}`)"),
        (c.scaling_factor not in (None, 1.0), "`scaling_factor`"),
        (c.routing_weight_on_input, "`routing_weight_on_input`"),
        (c.router_bias, "`router_bias`"),
        (c.expert_mlp_bias, "`expert_mlp_bias`"),
        (c.swiglu_limit is not None, "`swiglu_alpha`, `swiglu_limit`, `swiglu_up_offset`"),
        (c.shared_expert_ffn_size is not None and not c.shared_expert_gate, "shared expert"),
        (c.shared_expert_gate, "sigmoid-gated shared expert (`shared_expert_gate`)"),
        (fam.experts_transposed, "experts stored `[E, H, 2F]`"),
        (fam.gate_up_interleaved, "gate/up interleaved"),
        (hasattr(layer.hf_block, "jitter_noise"), "input jitter kept"),
        (fam.flat_output, "text and vision experts swapped apart"),
    ]
    return ", ".join(out + [text for on, text in flags if on])


def _row(fam: Family) -> str:
    if fam.refused is not None:
        model = _refused_model(fam.name)
        with pytest.raises(ValueError, match="cannot be swapped"):
            swap_moe_blocks(model)
        return f"| {fam.name} | `{fam.block}` | `{type(model).__name__}` | refused: {fam.refused} | |"
    name = TABLE_CONFIG[fam.name]
    model, layers = check_parity(name)
    check_export(name)
    layer = next(m for _, m in layers if m.family == fam.name)
    return f"| {fam.name} | `{fam.block}` | `{type(model).__name__}` | parity, exact export | {_options(fam, layer)} |"


def generated_table() -> str:
    rows = [_row(f) for f in sorted(FAMILIES.values(), key=lambda f: (f.refused is not None, f.name))]
    head = ["| family | HF block | model class (tiny config) | status | MoEConfig options |", "|---|---|---|---|---|"]
    return "\n".join(head + rows)


def test_every_family_has_a_tiny_model_here() -> None:
    swappable = {f.name for f in FAMILIES.values() if f.refused is None}
    assert swappable == set(TABLE_CONFIG), swappable ^ set(TABLE_CONFIG)
    assert {f.name for f in FAMILIES.values() if f.refused is not None} == set(REFUSED)


def test_docs_family_table_is_the_generated_one() -> None:
    table = generated_table()
    text = DOCS.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    if WRITE_DOCS:
        DOCS.write_text(f"{text[:start]}\n{table}\n{text[stop:]}")
        text = DOCS.read_text()
        start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    assert text[start:stop].strip() == table, (
        "docs/hf_models.md's family table differs from this sweep's; rewrite it with LIGHTNING_MOE_WRITE_DOCS=1."
    )
