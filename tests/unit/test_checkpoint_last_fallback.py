"""``ckpt_path="last"`` after a crash during the first write of ``last.ckpt`` (``folded_moe``, one device).

The ``step=N`` checkpoint is published before ``last.ckpt`` is written; when ``last`` is missing
(only its staging copy is there) or not complete, the Trainer resumes from the newest complete
checkpoint of the folder, with a warning naming it, instead of starting from step 0.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _checkpoint_trainer import checkpoint_trainer, tiny_data, tiny_model  # noqa: E402

from lightning_moe.checkpoint.atomic import staging_path  # noqa: E402
from lightning_moe.checkpoint.resume import last_or_newest_complete  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("last")
    checkpoint_trainer(out, 4).fit(tiny_model(), datamodule=tiny_data())
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
    trainer = checkpoint_trainer(out, 4)
    with pytest.warns(UserWarning, match=rf'ckpt_path="last".*{step4.name}'):
        trainer.fit(tiny_model(), datamodule=tiny_data(), ckpt_path="last")
    assert Path(trainer.ckpt_path) == step4, "started from step 0 instead of the complete step=4 checkpoint"
    assert trainer.global_step == 4


def test_a_complete_last_is_kept(run_dir: Path) -> None:
    assert last_or_newest_complete(run_dir / "last.ckpt", [run_dir]) == (run_dir / "last.ckpt", None)


def test_no_checkpoint_anywhere_keeps_lightnings_choice(tmp_path: Path) -> None:
    assert last_or_newest_complete(None, [tmp_path]) == (None, None)
