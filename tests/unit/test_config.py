"""MoEConfig: every broken rule raises ValueError at construction, naming the bad value."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lightning_moe.config import MoEConfig

BASE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)

BAD_CONFIGS = {
    "top_k_exceeds_num_experts": (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    "hidden_size_zero": (dict(hidden_size=0), "hidden_size=0"),
    "num_experts_not_int": (dict(num_experts=8.0), "num_experts=8.0"),
    "top_k_negative": (dict(top_k=-1), "top_k=-1"),
    "num_experts_not_divisible_by_num_groups": (
        dict(num_experts=6, num_groups=4, group_topk=1),
        "num_experts=6 is not divisible by num_groups=4",
    ),
    "group_topk_exceeds_num_groups": (dict(num_groups=2, group_topk=3, top_k=3), "group_topk=3"),
    "group_topk_zero": (dict(num_groups=2, group_topk=0), "group_topk=0"),
    "num_groups_without_group_topk": (dict(num_groups=4), "num_groups=4 and group_topk=None"),
    "group_topk_without_num_groups": (dict(group_topk=2), "num_groups=None and group_topk=2"),
    "top_k_not_divisible_by_group_topk": (
        dict(num_groups=4, group_topk=2, top_k=3),
        "top_k=3 must be divisible by group_topk=2",
    ),
    "kept_groups_hold_fewer_than_top_k": (
        dict(num_experts=8, num_groups=4, group_topk=1, top_k=3),
        "group_topk=1 groups of 2 experts hold fewer than top_k=3",
    ),
    "capacity_factor_zero": (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    "capacity_factor_negative": (dict(capacity_factor=-1.5), "capacity_factor=-1.5"),
    "capacity_factor_nan": (dict(capacity_factor=float("nan")), "capacity_factor=nan"),
    "unknown_score_func": (dict(score_func="relu"), "score_func='relu'"),
    "unknown_aux_loss": (dict(aux_loss="gshard"), "aux_loss='gshard'"),
    "unknown_drop_policy": (dict(capacity_factor=1.0, drop_policy="random"), "drop_policy='random'"),
    "unknown_experts_backend": (dict(experts_backend="cutlass"), "experts_backend='cutlass'"),
    "unknown_router_dtype": (dict(router_dtype="float16"), "router_dtype='float16'"),
    "pad_to_capacity_without_capacity": (dict(pad_to_capacity=True), "pad_to_capacity=True needs a capacity"),
    "softmax_top1_without_pre_softmax": (dict(top_k=1), "top_k=1 and pre_softmax=False"),
    "negative_aux_loss_coeff": (dict(aux_loss_coeff=-0.01), "aux_loss_coeff=-0.01"),
    "negative_z_loss_coeff": (dict(z_loss_coeff=-1e-3), "z_loss_coeff=-0.001"),
    "shared_expert_ffn_size_zero": (dict(shared_expert_ffn_size=0), "shared_expert_ffn_size=0"),
    "shared_expert_gate_without_shared_expert": (dict(shared_expert_gate=True), "shared_expert_gate=True"),
    "shared_expert_overlap_without_shared_expert": (dict(shared_expert_overlap=True), "shared_expert_overlap=True"),
    "negative_bias_update_rate": (dict(bias_update_rate=-0.5), "bias_update_rate=-0.5"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_value_error_naming_the_value(case: str) -> None:
    overrides, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        MoEConfig(**{**BASE, **overrides})
    assert str(info.value).startswith("MoEConfig: ")


def test_num_groups_error_lists_valid_choices() -> None:
    with pytest.raises(ValueError, match=re.escape("choose num_groups from [1, 2, 3, 6]")):
        MoEConfig(**{**BASE, "num_experts": 6, "num_groups": 4, "group_topk": 1})


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(top_k=1, pre_softmax=True),
        dict(score_func="sigmoid", top_k=1),
        dict(top_k=8),
        dict(score_func="sigmoid", top_k=4, num_groups=4, group_topk=2, expert_bias=True, scaling_factor=2.5),
        dict(num_groups=1, group_topk=1),
        dict(capacity_factor=1.25, drop_policy="position", pad_to_capacity=True),
        dict(shared_expert_ffn_size=16, shared_expert_gate=True, z_loss_coeff=1e-3, aux_loss="global"),
    ],
    ids=[
        "defaults",
        "pre_softmax_top1",
        "sigmoid_top1",
        "top_k_equals_E",
        "deepseek_v3_like",
        "one_group",
        "padded_capacity",
        "shared_expert",
    ],
)
def test_valid_configs_construct(overrides: dict) -> None:
    cfg = MoEConfig(**{**BASE, **overrides})
    assert dataclasses.replace(cfg) == cfg


def test_defaults_are_dropless_softmax_with_switch_loss() -> None:
    cfg = MoEConfig(**BASE)
    assert cfg.capacity_factor is None and cfg.score_func == "softmax" and cfg.aux_loss == "switch"
    assert cfg.memory_efficient_permute and cfg.num_groups is None and not cfg.expert_bias


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("float64", torch.float64), ("bfloat16", torch.bfloat16)]
)
def test_router_torch_dtype(name: str, dtype: torch.dtype) -> None:
    assert MoEConfig(**BASE, router_dtype=name).router_torch_dtype is dtype


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        MoEConfig(16, 8, 8, 2)  # type: ignore[misc]
