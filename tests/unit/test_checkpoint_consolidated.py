"""A ``folded_moe`` DCP folder made one file by Lightning's own tool
(``python -m lightning.fabric.utilities.consolidate_checkpoint FOLDER``) loads without the strategy.

* ``MoELanguageModel.load_from_checkpoint`` gives the saved weights (``w13``'s gate/up halves
  joined by ``on_load_checkpoint``);
* ``Trainer(strategy="auto").fit(ckpt_path=...)`` resumes from it: weights, optimizer state and
  loop state, ending where the folded run resumed from the folder ends.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from _resume_run import model_config  # noqa: E402

import lightning_moe  # noqa: F401, E402
from lightning_moe.data import MoEDataModule  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402


def _trainer(out: Path, steps: int, strategy: Any) -> pl.Trainer:
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, callbacks=[ckpt], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _folded() -> FoldedMoEStrategy:
    return FoldedMoEStrategy(timeout=timedelta(seconds=60))


def _model() -> MoELanguageModel:
    torch.manual_seed(0)
    return MoELanguageModel(model_config(), warmup_steps=1, log_layer_load=False)


def _data() -> MoEDataModule:
    return MoEDataModule(seq_len=16, batch_size=4, max_bytes=520, val_fraction=0.05, seed=7)


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MoELanguageModel]:
    out = tmp_path_factory.mktemp("consolidate")
    trained = _model()
    _trainer(out, 2, _folded()).fit(trained, datamodule=_data())
    folder = out / "last.ckpt"
    assert folder.is_dir()
    file = out / "consolidated.ckpt"
    tool = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(folder), "--output_file", str(file)]
    subprocess.run(tool, check=True, capture_output=True, text=True)
    assert any(k.endswith(".w13.gate") for k in torch.load(file, weights_only=True)["state_dict"])
    return file, trained


def test_load_from_checkpoint_reads_a_consolidated_folder(consolidated: tuple[Path, MoELanguageModel]) -> None:
    file, trained = consolidated
    back = MoELanguageModel.load_from_checkpoint(file, weights_only=True)
    for (name, want), got in zip(trained.state_dict().items(), back.state_dict().values()):
        assert torch.equal(want, got), name


def test_auto_strategy_resumes_from_a_consolidated_folder(
    consolidated: tuple[Path, MoELanguageModel], tmp_path: Path
) -> None:
    file, _ = consolidated
    from_folder = _model()
    _trainer(tmp_path / "a", 4, _folded()).fit(from_folder, datamodule=_data(), ckpt_path=file.parent / "last.ckpt")
    from_file = _model()
    _trainer(tmp_path / "b", 4, "auto").fit(from_file, datamodule=_data(), ckpt_path=file)
    assert from_file.trainer.global_step == 4
    for (name, want), got in zip(from_folder.state_dict().items(), from_file.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
