"""TP plans per attention / dense-MLP class (``parallel/tp_plans.py``): coverage and clear refusals.

Collective-free checks (``check_model_for_layout`` at ``tp=2``): every family's attention class has
a plan or a refusal with its reason; linear attention (Qwen3-Next / Qwen3.5 Gated DeltaNet, MiniMax
lightning attention) is refused naming the layer; an unknown attention class is refused naming the
class; head counts come from each class's own projections (Qwen3-Next's gated query holds two
head widths per head, DeepSeek's MLA counts ``q_b_proj`` / ``kv_b_proj`` heads). The numerics at
TP2 are in ``tests/dist/test_dist_hf_tp.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf import swap_moe_blocks  # noqa: E402
from lightning_moe.parallel.layout import FoldedLayout  # noqa: E402
from lightning_moe.parallel.parallelize import check_model_for_layout  # noqa: E402
from lightning_moe.parallel.tp_apply import head_count, tp_targets  # noqa: E402
from lightning_moe.parallel.tp_plans import AttentionPlan, attention_plan_of  # noqa: E402

from test_hf_families import CONFIGS, hf_model  # noqa: E402

TP2 = FoldedLayout(2, tp=2)
_LINEAR_ATTENTION = {"qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
                     "minimax": "MiniMaxLightningAttention"}  # fmt: skip


@pytest.fixture(scope="module")
def swapped() -> dict[str, nn.Module]:
    return {name: swap_moe_blocks(hf_model(name), experts_backend="torch") for name in CONFIGS}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_has_a_plan_or_a_reason(swapped: dict[str, nn.Module], name: str) -> None:
    model = swapped[name]
    targets = tp_targets(model)
    assert any(isinstance(plan, AttentionPlan) for _, _, plan in targets)
    family = CONFIGS[name][0].removesuffix("_text")
    if family in _LINEAR_ATTENTION:
        cls = _LINEAR_ATTENTION[family]
        with pytest.raises(ValueError, match=rf"tp=2 is unsupported for model\.layers\.0\.\w+ \({cls}\): its "):
            check_model_for_layout(model, TP2)
    else:
        check_model_for_layout(model, TP2)
    check_model_for_layout(model, FoldedLayout(1))  # TP=1 reads no plan


def test_gated_query_counts_each_head_once() -> None:
    model = hf_model("qwen3_next", layer_types=["full_attention", "full_attention"])
    attn = model.model.layers[0].self_attn
    plan = attention_plan_of(attn)
    assert plan is not None and attn.q_proj.out_features == 2 * 4 * attn.head_dim
    assert head_count(attn, plan.query_heads) == 4 and head_count(attn, plan.kv_heads) == 2
    check_model_for_layout(model, TP2)
    with pytest.raises(ValueError, match=r"tp=4 must divide the 4 query and 2 key/value heads .*Qwen3NextAttention"):
        check_model_for_layout(model, FoldedLayout(4, tp=4))


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_mla_heads_come_from_its_b_projections(q_lora_rank: int | None) -> None:
    model = hf_model("deepseek_v2", q_lora_rank=q_lora_rank, num_attention_heads=2, num_key_value_heads=2)
    attn = model.model.layers[0].self_attn
    plan = attention_plan_of(attn)
    assert plan is not None
    assert head_count(attn, plan.query_heads) == 2 and head_count(attn, plan.kv_heads) == 2
    check_model_for_layout(model, TP2)
    with pytest.raises(ValueError, match=r"tp=4 must divide the 2 query and 2 key/value heads .*DeepseekV2Attention"):
        check_model_for_layout(model, FoldedLayout(4, tp=4))


class MysteryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):  # pragma: no cover - never run
        return x


def test_unknown_attention_class_is_refused_at_tp2_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), MysteryAttention())
    with pytest.raises(ValueError, match=r"tp=2 is unsupported for 1 \(MysteryAttention\): no tensor-parallel plan"):
        check_model_for_layout(model, TP2)
    check_model_for_layout(model, FoldedLayout(1))


def test_plan_naming_a_missing_projection_is_refused() -> None:
    model = hf_model("olmoe")
    broken = copy.deepcopy(model)
    del broken.model.layers[0].self_attn.k_proj
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(OlmoeAttention\) has no \['k_proj'\]"):
        check_model_for_layout(broken, TP2)
