"""MoELanguageModel's AdamW: kernel choice and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.optimizer import adamw_kernel_kwargs as _adamw_kernels
from lightning_moe.models.transformer import TransformerConfig


def _lm(**kwargs: object) -> MoELanguageModel:
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    return MoELanguageModel(TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, moe=moe), **kwargs)  # type: ignore[arg-type]


def test_auto_fuses_only_when_every_parameter_is_on_cuda() -> None:
    cpu = [torch.zeros(2)]
    assert _adamw_kernels("auto", cpu) == {}
    assert _adamw_kernels("foreach", cpu) == {"foreach": True}
    assert _adamw_kernels("fused", cpu) == {"fused": True}
    meta_cuda = torch.empty(2, device="meta")  # neither CPU nor CUDA: still not fused
    assert _adamw_kernels("auto", [meta_cuda]) == {}


def test_configure_optimizers_on_cpu_keeps_torch_default_and_groups() -> None:
    opt = _lm().configure_optimizers()["optimizer"]
    assert isinstance(opt, torch.optim.AdamW)
    assert not opt.param_groups[0]["fused"] and opt.param_groups[1]["weight_decay"] == 0.0
    opt = _lm(optimizer_impl="foreach").configure_optimizers()["optimizer"]
    assert opt.param_groups[0]["foreach"] is True


def test_unknown_optimizer_impl_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"optimizer_impl='apex' is unknown"):
        _lm(optimizer_impl="apex")


def test_warmup_cosine_ramps_linearly_then_decays_to_ten_percent_of_peak() -> None:
    """warmup=4, total=14: (step+1)/4 for steps 0..3, then 0.1 + 0.45 * (1 + cos(pi * (step-4)/10))."""
    from lightning_moe.optimizer import warmup_cosine

    schedule = warmup_cosine(4, 14)
    want = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: 0.55, 14: 0.1, 40: 0.1}
    for step, factor in want.items():
        assert schedule(step) == pytest.approx(factor, abs=1e-12), step
    assert schedule(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)), abs=1e-12)


def test_scheduler_from_configure_optimizers_starts_at_the_first_warmup_fraction() -> None:
    lm = _lm(learning_rate=1e-2, warmup_steps=5)
    scheduler = lm.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert scheduler.get_last_lr() == pytest.approx([1e-2 / 5, 1e-2 / 5], rel=1e-12)


def test_weight_decay_applies_to_every_matrix_and_no_vector() -> None:
    """Group 0 (decayed) holds exactly the >=2-D parameters (embeddings, projections, router, experts)."""
    lm = _lm(weight_decay=0.3)
    decay, no_decay = lm.configure_optimizers()["optimizer"].param_groups
    by_id = {id(p): name for name, p in lm.named_parameters()}
    want_decay = {name for name, p in lm.named_parameters() if p.dim() >= 2}
    assert {by_id[id(p)] for p in decay["params"]} == want_decay
    assert {by_id[id(p)] for p in no_decay["params"]} == {n for n, p in lm.named_parameters() if p.dim() < 2}
    assert any(n.endswith("router.weight") for n in want_decay) and any(n.endswith("w13") for n in want_decay)
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
