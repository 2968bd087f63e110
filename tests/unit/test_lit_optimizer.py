"""MoELanguageModel's AdamW: kernel choice and bad input."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel, _adamw_kernels
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
