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
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _checkpoint_trainer import checkpoint_trainer, folded, tiny_data, tiny_model  # noqa: E402

from lightning_moe.lit import MoELanguageModel  # noqa: E402


@pytest.fixture(scope="module")
def consolidated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MoELanguageModel]:
    out = tmp_path_factory.mktemp("consolidate")
    trained = tiny_model()
    checkpoint_trainer(out, 2, folded()).fit(trained, datamodule=tiny_data())
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
    from_folder = tiny_model()
    folder = file.parent / "last.ckpt"
    checkpoint_trainer(tmp_path / "a", 4, folded()).fit(from_folder, datamodule=tiny_data(), ckpt_path=folder)
    from_file = tiny_model()
    checkpoint_trainer(tmp_path / "b", 4, "auto").fit(from_file, datamodule=tiny_data(), ckpt_path=file)
    assert from_file.trainer.global_step == 4
    for (name, want), got in zip(from_folder.state_dict().items(), from_file.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
