"""MoELanguageModel's AdamW: kernel choice and bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.optimizer import OptimizerConfig
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


# --- OptimizerConfig: one typed config, the flat arguments deprecated -----------------------------

TINY_MODEL = {"vocab_size": 32, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
              "moe": {"hidden_size": 16, "ffn_hidden_size": 8, "num_experts": 4, "top_k": 2}}  # fmt: skip


def test_the_config_and_the_deprecated_flat_arguments_build_the_same_optimizer() -> None:
    config = OptimizerConfig(learning_rate=1e-2, weight_decay=0.2, warmup_steps=5, betas=(0.8, 0.9))
    typed = _lm(optimizer=config)
    with pytest.warns(DeprecationWarning, match="learning_rate, warmup_steps, weight_decay as separate arguments"):
        flat = _lm(learning_rate=1e-2, weight_decay=0.2, warmup_steps=5, betas=(0.8, 0.9))
    assert typed.optimizer_config == flat.optimizer_config == config == _lm(optimizer=config.as_dict()).optimizer_config
    assert typed.hparams["optimizer"] == flat.hparams["optimizer"] == config
    assert not {"learning_rate", "weight_decay", "warmup_steps", "betas"} & set(flat.hparams)
    group = flat.configure_optimizers()["optimizer"].param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-2 / 5, (0.8, 0.9), 0.2)


def test_a_field_given_both_ways_or_unknown_is_refused() -> None:
    with pytest.raises(ValueError, match=r"MoELanguageModel: learning_rate=0.1 given next to optimizer=\.\.\."):
        _lm(optimizer=OptimizerConfig(), learning_rate=0.1)
    with pytest.raises(ValueError, match=r"MoELanguageModel: optimizer has unknown fields \['lr'\]"):
        _lm(optimizer={"lr": 0.1})
    with pytest.raises(ValueError, match=r"OptimizerConfig: warmup_steps=-1 must be an int >= 0"):
        OptimizerConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"MoELanguageModel: betas=\(1.0, 0.9\) must be two numbers"):
        _lm(optimizer={"betas": (1.0, 0.9)})


def test_the_checkpoint_stores_the_config_as_a_dict_that_rebuilds_the_module() -> None:
    lm = _lm(optimizer=OptimizerConfig(learning_rate=2e-3, optimizer_impl="foreach"))
    checkpoint = {"hyper_parameters": dict(lm.hparams)}
    lm.on_save_checkpoint(checkpoint)
    stored = checkpoint["hyper_parameters"]
    assert stored["optimizer"] == {"learning_rate": 2e-3, "weight_decay": 0.1, "warmup_steps": 20,
                                   "betas": (0.9, 0.95), "optimizer_impl": "foreach"}  # fmt: skip
    rebuilt = MoELanguageModel(**stored)
    assert rebuilt.optimizer_config == lm.optimizer_config


@pytest.mark.parametrize("form", ["typed", "flat"])
def test_the_cli_takes_the_optimizer_config_and_the_flat_keys(form: str) -> None:
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(MoELanguageModel, "model", subclass_mode=True)
    given = {"optimizer": {"learning_rate": 0.01, "warmup_steps": 4}} if form == "typed" else {"learning_rate": 0.01, "warmup_steps": 4}
    config = parser.parse_object({"model": {"class_path": "lightning_moe.lit.MoELanguageModel",
                                            "init_args": {"model": TINY_MODEL, **given}}})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = parser.instantiate(config).model
    assert module.optimizer_config == OptimizerConfig(learning_rate=0.01, warmup_steps=4)
