"""Crash-safe, verified checkpoints on one process (``folded_moe`` on one device, DCP folder).

* a save is written aside and published by rename: a save that dies half-way leaves ``last.ckpt``
  as the previous complete checkpoint, nothing half-written under a checkpoint name;
* every file of a folder is checked against the manifest before anything loads: bit rot, a
  truncated shard and a missing ``.metadata`` are refused with the folder and the file named,
  and the weights are untouched;
* the folder ``folded_moe`` wrote on one device loads back on one device (resume);
* ``torch.load(weights_only=True)`` reads ``meta.pt`` and a one-process ``.ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _checkpoint_trainer import checkpoint_trainer, model_config, tiny_data, tiny_model  # noqa: E402

from lightning_moe.checkpoint import MANIFEST_NAME, CheckpointError, newest_complete_checkpoint  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402


class _Killed(RuntimeError):
    """A save stopped after its shards were written (a kill at the worst moment)."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    checkpoint_trainer(out, 4).fit(tiny_model(), datamodule=tiny_data())
    return out


def _shard(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_folders_are_published_complete_with_a_manifest(run_dir: Path) -> None:
    last = run_dir / "last.ckpt"
    assert (last / MANIFEST_NAME).is_file() and (last / ".metadata").is_file()
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")], "staging left behind"
    meta = torch.load(last / "meta.pt", weights_only=True)  # no allow-list needed
    assert meta["global_step"] == 4
    assert meta["hyper_parameters"]["model"]["__config__"] == "TransformerConfig"


def test_a_save_that_dies_half_way_keeps_the_previous_last(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    out = _copy(run_dir, tmp_path / "ck")
    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def dies(state: Any, checkpoint_id: Any = None, **kw: Any) -> Any:
        real(state, checkpoint_id=checkpoint_id, **kw)
        raise _Killed("killed while saving")

    trainer = checkpoint_trainer(out, 6)
    monkeypatch.setattr(dcp, "save", dies)
    with pytest.raises(_Killed):
        trainer.fit(tiny_model(), datamodule=tiny_data(), ckpt_path=out / "last.ckpt")
    monkeypatch.setattr(dcp, "save", real)
    assert torch.load(out / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 4
    published = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    assert not [n for n in published if "step=6" in n], f"a half-written checkpoint was published: {published}"
    assert newest_complete_checkpoint(out) is not None
    resumed = tiny_model()
    checkpoint_trainer(out, 6).fit(resumed, datamodule=tiny_data(), ckpt_path="last")  # the old last is whole and loads
    assert resumed.trainer.global_step == 6


def _zeroed() -> MoELanguageModel:
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


@pytest.mark.parametrize("damage", ["bitrot", "truncate", "no_metadata", "no_shard"])
def test_a_damaged_folder_is_refused_naming_the_file_before_any_weight_changes(
    run_dir: Path, tmp_path: Path, damage: str
) -> None:
    folder = _copy(run_dir / "last.ckpt", tmp_path / "step.ckpt")
    shard = _shard(folder)
    if damage == "bitrot":
        data = bytearray(shard.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(64)  # same size, other bytes
        shard.write_bytes(bytes(data))
        name, why = shard.name, "checksum"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        name, why = shard.name, "bytes"
    elif damage == "no_shard":
        shard.unlink()
        name, why = shard.name, "missing"
    else:
        (folder / ".metadata").unlink()
        name, why = ".metadata", "missing"
    model = _zeroed()
    with pytest.raises(CheckpointError, match=rf"{folder.name}.*{name}.*{why}"):
        checkpoint_trainer(tmp_path / "other", 6).fit(model, datamodule=tiny_data(), ckpt_path=folder)
    assert all(not p.any() for p in model.parameters()), "weights changed before the refusal"


def test_one_device_resumes_its_own_folder_bitwise(run_dir: Path, tmp_path: Path) -> None:
    straight = tiny_model()
    checkpoint_trainer(tmp_path / "a", 4).fit(straight, datamodule=tiny_data())
    zero = _zeroed()
    last = run_dir / "last.ckpt"
    checkpoint_trainer(tmp_path / "b", 4).validate(zero, datamodule=tiny_data(), ckpt_path=last, verbose=False)
    for (name, want), got in zip(straight.state_dict().items(), zero.state_dict().values()):
        assert torch.equal(want, got), name


def test_one_process_ckpt_loads_weights_only(tmp_path: Path) -> None:
    checkpoint_trainer(tmp_path, 2, strategy="auto").fit(tiny_model(), datamodule=tiny_data())
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["model"]["moe"]["__config__"] == "MoEConfig"
    back = MoELanguageModel.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert back.config == model_config()

