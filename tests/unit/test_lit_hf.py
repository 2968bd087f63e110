"""HFMoELanguageModel: the HF recipe runs through the CLI, and the module builds what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.cli import main
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.hf import HFMoELayer
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.moe.utils import find_moe_layers

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "hf_qwen3_moe_tiny.yaml"
TINY = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


def test_hf_recipe_yaml_fits_three_steps_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One process, no process group (tests/dist/test_dist_hf_export.py runs the YAML as written).
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.log_every_n_steps=1",
            "--data.init_args.max_bytes=300000",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validation loss:")][-1]
    assert "at step 3" in line
    metrics = (next(tmp_path.rglob("metrics.csv"))).read_text()
    assert "train/load_balancing_loss" in metrics and "train/loss" in metrics


def test_module_swaps_blocks_and_counts_active_params() -> None:
    lit = HFMoELanguageModel(hf_config=TINY, moe={"experts_backend": "loop"})
    layers = find_moe_layers(lit.model)
    assert len(layers) == 2 and all(isinstance(m, HFMoELayer) for _, m in layers)
    assert {m.config.experts_backend for _, m in layers} == {"loop"}
    total_experts = sum(p.numel() for _, m in layers for p in m.experts.parameters())
    embed = lit.model.get_input_embeddings().weight.numel()
    all_params = sum(p.numel() for p in lit.parameters())
    assert lit.num_active_params() == all_params - embed - total_experts + total_experts * 2 // 8
    ids = torch.randint(0, 64, (2, 8))
    loss = lit._lm_loss({"input_ids": ids, "labels": ids})
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_module_without_swap_keeps_hf_blocks() -> None:
    lit = HFMoELanguageModel(hf_config=TINY, swap=False, experts_implementation="eager")
    assert not find_moe_layers(lit.model)
    assert lit.model.config._experts_implementation == "eager"


def test_module_loads_a_local_checkpoint_directory(tmp_path: Path) -> None:
    ref = HFMoELanguageModel(hf_config=TINY, swap=False)
    ref.model.save_pretrained(tmp_path)
    lit = HFMoELanguageModel(pretrained=str(tmp_path))
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(lit.eval()(ids), ref.eval()(ids), atol=1e-5, rtol=1e-5)


def test_module_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one of hf_config"):
        HFMoELanguageModel()
    with pytest.raises(ValueError, match="has no model_type"):
        HFMoELanguageModel(hf_config={"hidden_size": 8})


def test_module_rejects_missing_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        HFMoELanguageModel(pretrained=str(tmp_path))


def test_module_shares_the_base_and_saves_every_init_argument() -> None:
    """Both LightningModules derive from one base (the CLI's); the HF one saves its own arguments."""
    from lightning_moe.lit import MoELanguageModel, MoELanguageModelBase

    lit = HFMoELanguageModel(hf_config=TINY, warmup_steps=3, optimizer_impl="foreach", fused_norms=False)
    assert isinstance(lit, MoELanguageModelBase) and not isinstance(lit, MoELanguageModel)
    assert issubclass(MoELanguageModel, MoELanguageModelBase)
    assert dict(lit.hparams) == {
        "hf_config": TINY, "pretrained": None, "moe": None, "swap": True, "dtype": "float32",
        "attn_implementation": "sdpa", "experts_implementation": None, "fused_norms": False,
        "load_sharded": False, "log_layer_load": True,
        "optimizer": OptimizerConfig(learning_rate=3e-3, weight_decay=0.1, warmup_steps=3, betas=(0.9, 0.95),
                                     optimizer_impl="foreach"),
    }  # fmt: skip
    assert lit.val_history == [] and lit.device_mesh is None
    with pytest.raises(ValueError, match="HFMoELanguageModel: optimizer_impl='fast' is unknown"):
        HFMoELanguageModel(hf_config=TINY, optimizer_impl="fast")


def test_expert_init_seed_keeps_pretrained_experts_and_trained_ones_on_validate(tmp_path: Path) -> None:
    """``FoldedMoEStrategy(expert_init_seed=...)`` seeds experts it builds, never experts loaded from
    ``pretrained``, and not again when ``validate`` sets the strategy up after ``fit``."""
    from datetime import timedelta

    import lightning as L

    from lightning_moe.strategies import FoldedMoEStrategy

    ref = HFMoELanguageModel(hf_config=TINY, swap=False)
    ref.model.save_pretrained(tmp_path / "ckpt")
    lit = HFMoELanguageModel(pretrained=str(tmp_path / "ckpt"))
    loaded = {n: p.detach().clone() for n, p in lit.named_parameters() if ".experts." in n}
    assert loaded and all(layer.experts.seeded_or_loaded for _, layer in find_moe_layers(lit.model))
    ids = torch.randint(0, 64, (4, 8))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=FoldedMoEStrategy(expert_init_seed=3, timeout=timedelta(seconds=60)),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.validate(lit, dataloaders=loader)
    for name, want in loaded.items():  # the strategy's setup left the pretrained experts
        torch.testing.assert_close(_local(dict(lit.named_parameters())[name]), want, rtol=0, atol=0)
    fresh = HFMoELanguageModel(hf_config=TINY)  # experts built here: seeded on the first setup only
    built = {n: p.detach().clone() for n, p in fresh.named_parameters() if ".experts." in n}
    trainer.validate(fresh, dataloaders=loader)
    seeded = {n: _local(p) for n, p in fresh.named_parameters() if ".experts." in n}
    assert any(not torch.equal(seeded[n], built[n]) for n in built), "expert_init_seed did not seed"
    with torch.no_grad():
        for p in seeded.values():
            p.add_(1.0)  # as training would change them
    trained = {n: p.clone() for n, p in seeded.items()}
    trainer.validate(fresh, dataloaders=loader)  # set up again: no second seeding
    for name, want in trained.items():
        torch.testing.assert_close(_local(dict(fresh.named_parameters())[name]), want, rtol=0, atol=0)


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()
