"""The console script: --print_config round-trips, and a short fit lowers the validation loss."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from lightning_moe.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.yaml"


def _print_config(args: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_info:
        main(args + ["--print_config"])
    assert exit_info.value.code in (0, None)
    return buf.getvalue()


def test_print_config_round_trips(tmp_path: Path) -> None:
    first = _print_config(["fit", "--config", str(CONFIG)])
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    second = _print_config(["fit", "--config", str(saved)])
    assert yaml.safe_load(first) == yaml.safe_load(second)
    moe = yaml.safe_load(first)["model"]["init_args"]["model"]["moe"]
    assert moe["num_experts"] == 8 and moe["top_k"] == 2 and moe["check_finite"] is True


def test_fit_lowers_validation_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_steps=30",
            "--trainer.val_check_interval=30",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validation loss:")][-1]
    first, last = float(line.split()[2]), float(line.split()[7])
    assert last < 0.85 * first, line


def test_bad_moe_value_is_rejected_by_the_cli() -> None:
    with pytest.raises((SystemExit, ValueError)):
        with contextlib.redirect_stderr(io.StringIO()):
            main(["fit", "--config", str(CONFIG), "--model.init_args.model.moe.top_k=9", "--trainer.max_steps=1"])
