"""One-file checkpoints of ``folded_moe`` (``save_distributed_checkpoint=False``) on one device.

* the ``.ckpt`` a one-device run wrote resumes that run: weights, optimizer and loop state come
  back, and the resumed run ends with the weights of one that never stopped;
* the file stores ``w13`` in the one-process ``[gate | up]`` layout with a marker, so a plain
  Lightning model (``load_from_checkpoint``) reads it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _checkpoint_trainer import checkpoint_trainer, folded, tiny_data, tiny_model  # noqa: E402

from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.strategies.checkpoint_io import W13_FORMAT_KEY  # noqa: E402


def _trainer(out: Path, steps: int) -> pl.Trainer:
    """The checkpoint Trainer with ``folded_moe`` writing one file per checkpoint."""
    return checkpoint_trainer(out, steps, folded(save_distributed_checkpoint=False))


def test_one_device_resumes_its_own_file_bitwise(tmp_path: Path) -> None:
    straight = tiny_model()
    _trainer(tmp_path / "a", 4).fit(straight, datamodule=tiny_data())
    step2 = next((tmp_path / "a").glob("*step=2.ckpt"))
    assert step2.is_file(), "save_distributed_checkpoint=False writes one file"
    resumed = tiny_model()
    _trainer(tmp_path / "b", 4).fit(resumed, datamodule=tiny_data(), ckpt_path=step2)
    assert resumed.trainer.global_step == 4
    for (name, want), got in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(want, got), name


def test_the_file_is_marked_and_loads_into_a_plain_model(tmp_path: Path) -> None:
    trained = tiny_model()
    _trainer(tmp_path, 2).fit(trained, datamodule=tiny_data())
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt[W13_FORMAT_KEY] == "gate_up"
    back = MoELanguageModel.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    for (name, want), got in zip(trained.state_dict().items(), back.state_dict().values()):
        assert torch.equal(want, got), name


def test_export_refuses_etp_for_a_marked_file(tmp_path: Path) -> None:
    """The marked file holds w13 as [gate | up]: un-blocking it again for --etp would scramble the experts."""
    import pytest

    from lightning_moe.export import _stores_w13_layout_free

    _trainer(tmp_path, 2).fit(tiny_model(), datamodule=tiny_data())
    assert _stores_w13_layout_free(tmp_path / "last.ckpt")
    unmarked = torch.load(tmp_path / "last.ckpt", weights_only=True)
    del unmarked[W13_FORMAT_KEY]
    torch.save(unmarked, tmp_path / "old.ckpt")
    assert not _stores_w13_layout_free(tmp_path / "old.ckpt")  # a file from before the marker: --etp applies
    from lightning_moe.export import export_checkpoint

    with pytest.raises(ValueError, match=r"etp=2 is not needed .* drop --etp"):
        export_checkpoint(tmp_path / "last.ckpt", tmp_path / "out", hf_config={"model_type": "qwen3_moe"}, etp=2)
