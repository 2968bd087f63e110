"""One-file checkpoints of ``folded_moe`` (``save_distributed_checkpoint=False``) on one device.

* the ``.ckpt`` a one-device run wrote resumes that run: weights, optimizer and loop state come
  back, and the resumed run ends with the weights of one that never stopped;
* the file stores ``w13`` in the one-process ``[gate | up]`` layout with a marker, so a plain
  Lightning model (``load_from_checkpoint``) reads it too.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from _resume_run import model_config  # noqa: E402

import lightning_moe  # noqa: F401, E402
from lightning_moe.data import MoEDataModule  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402
from lightning_moe.strategies.checkpoint_io import W13_FORMAT_KEY  # noqa: E402


def _trainer(out: Path, steps: int) -> pl.Trainer:
    strategy = FoldedMoEStrategy(save_distributed_checkpoint=False, timeout=timedelta(seconds=60))
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, callbacks=[ckpt], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _model() -> MoELanguageModel:
    torch.manual_seed(0)
    return MoELanguageModel(model_config(), warmup_steps=1, log_layer_load=False)


def _data() -> MoEDataModule:
    return MoEDataModule(seq_len=16, batch_size=4, max_bytes=520, val_fraction=0.05, seed=7)


def test_one_device_resumes_its_own_file_bitwise(tmp_path: Path) -> None:
    straight = _model()
    _trainer(tmp_path / "a", 4).fit(straight, datamodule=_data())
    step2 = next((tmp_path / "a").glob("*step=2.ckpt"))
    assert step2.is_file(), "save_distributed_checkpoint=False writes one file"
    resumed = _model()
    _trainer(tmp_path / "b", 4).fit(resumed, datamodule=_data(), ckpt_path=step2)
    assert resumed.trainer.global_step == 4
    for (name, want), got in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(want, got), name


def test_the_file_is_marked_and_loads_into_a_plain_model(tmp_path: Path) -> None:
    trained = _model()
    _trainer(tmp_path, 2).fit(trained, datamodule=_data())
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt[W13_FORMAT_KEY] == "gate_up"
    back = MoELanguageModel.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    for (name, want), got in zip(trained.state_dict().items(), back.state_dict().values()):
        assert torch.equal(want, got), name


def test_export_refuses_etp_for_a_marked_file(tmp_path: Path) -> None:
    """The marked file holds w13 as [gate | up]: un-blocking it again for --etp would scramble the experts."""
    import pytest

    from lightning_moe.export import _stores_w13_layout_free

    _trainer(tmp_path, 2).fit(_model(), datamodule=_data())
    assert _stores_w13_layout_free(tmp_path / "last.ckpt")
    unmarked = torch.load(tmp_path / "last.ckpt", weights_only=True)
    del unmarked[W13_FORMAT_KEY]
    torch.save(unmarked, tmp_path / "old.ckpt")
    assert not _stores_w13_layout_free(tmp_path / "old.ckpt")  # a file from before the marker: --etp applies
    from lightning_moe.export import export_checkpoint

    with pytest.raises(ValueError, match=r"etp=2 is not needed .* drop --etp"):
        export_checkpoint(tmp_path / "last.ckpt", tmp_path / "out", hf_config={"model_type": "qwen3_moe"}, etp=2)
