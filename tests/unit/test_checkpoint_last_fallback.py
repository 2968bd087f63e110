"""``ckpt_path="last"`` after a crash during the first write of ``last.ckpt`` (``folded_moe``, one device).

The ``step=N`` checkpoint is published before ``last.ckpt`` is written; when ``last`` is missing
(only its staging copy is there) or not complete, the Trainer resumes from the newest complete
checkpoint of the folder, with a warning naming it, instead of starting from step 0.
"""

from __future__ import annotations

import shutil
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from _resume_run import model_config  # noqa: E402

import lightning_moe  # noqa: F401, E402
from lightning_moe.checkpoint.atomic import staging_path  # noqa: E402
from lightning_moe.checkpoint.resume import last_or_newest_complete  # noqa: E402
from lightning_moe.data import MoEDataModule  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402


def _trainer(out: Path, steps: int) -> pl.Trainer:
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=FoldedMoEStrategy(timeout=timedelta(seconds=60)), max_steps=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, callbacks=[ckpt], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def _model() -> MoELanguageModel:
    torch.manual_seed(0)
    return MoELanguageModel(model_config(), warmup_steps=1, log_layer_load=False)


def _data() -> MoEDataModule:
    return MoEDataModule(seq_len=16, batch_size=4, max_bytes=520, val_fraction=0.05, seed=7)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("last")
    _trainer(out, 4).fit(_model(), datamodule=_data())
    return out


def _crashed(run_dir: Path, dst: Path, how: str) -> Path:
    out = dst / "ck"
    shutil.copytree(run_dir, out)
    last = out / "last.ckpt"
    if how == "missing":  # killed during the first write: only the staging copy, without its manifest
        last.rename(staging_path(last))
        (staging_path(last) / "manifest.json").unlink()
    else:  # a folder under the name whose shards do not match its manifest
        shard = max(last.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:-100])
    return out


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_last_falls_back_to_the_newest_complete_checkpoint(run_dir: Path, tmp_path: Path, how: str) -> None:
    out = _crashed(run_dir, tmp_path, how)
    step4 = next(out.glob("*step=4.ckpt"))
    trainer = _trainer(out, 4)
    with pytest.warns(UserWarning, match=rf'ckpt_path="last".*{step4.name}'):
        trainer.fit(_model(), datamodule=_data(), ckpt_path="last")
    assert Path(trainer.ckpt_path) == step4, "started from step 0 instead of the complete step=4 checkpoint"
    assert trainer.global_step == 4


def test_a_complete_last_is_kept(run_dir: Path) -> None:
    assert last_or_newest_complete(run_dir / "last.ckpt", [run_dir]) == (run_dir / "last.ckpt", None)


def test_no_checkpoint_anywhere_keeps_lightnings_choice(tmp_path: Path) -> None:
    assert last_or_newest_complete(None, [tmp_path]) == (None, None)
