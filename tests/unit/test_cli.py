"""The console script: --print_config round-trips, a short fit lowers the validation loss, and
``--config`` takes a packaged recipe by name (a path still wins)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from lightning_moe.cli import main, resolve_config_args
from lightning_moe.resources import recipe_names

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


# --- recipes by name --------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["tiny_moe", "tiny_moe.yaml"])
@pytest.mark.parametrize("form", ["--config", "-c", "--config="])
def test_recipe_name_becomes_the_packaged_file(given: str, form: str) -> None:
    args = ["fit", f"{form}{given}"] if form.endswith("=") else ["fit", form, given]
    resolved = resolve_config_args([*args, "--trainer.max_steps=3"])
    expected = [f"{form}{CONFIG}"] if form.endswith("=") else [form, str(CONFIG)]
    assert resolved == ["fit", *expected, "--trainer.max_steps=3"]


def test_recipe_name_runs_like_its_path() -> None:
    by_name = yaml.safe_load(_print_config(["fit", "--config", "tiny_moe"]))
    by_path = yaml.safe_load(_print_config(["fit", "--config", str(CONFIG)]))
    assert by_name == by_path


def test_existing_file_wins_over_a_recipe_of_the_same_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("tiny_moe").write_text(CONFIG.read_text().replace("max_steps: 200", "max_steps: 7"))
    assert resolve_config_args(["fit", "--config", "tiny_moe"]) == ["fit", "--config", "tiny_moe"]
    assert yaml.safe_load(_print_config(["fit", "--config", "tiny_moe"]))["trainer"]["max_steps"] == 7


@pytest.mark.parametrize("given", ["tiny_mo", "configs/no_such_recipe.yaml"])
def test_unknown_recipe_exits_with_one_line_listing_the_recipes(given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", given])
    message = str(exit_info.value.code)
    assert message.startswith(f"lightning-moe: --config={given} names no file and no packaged recipe;"), message
    assert "\n" not in message
    assert all(name in message for name in recipe_names()) and "tiny_moe_folded" in message


def test_inline_yaml_and_other_arguments_pass_through() -> None:
    args = ["fit", "--config", "trainer: {max_steps: 2}", "--trainer.max_steps=3", "--", "--config", "tiny_mo"]
    assert resolve_config_args(args) == args


def test_recipes_lists_every_config_with_its_file(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes"])
    lines = capsys.readouterr().out.splitlines()
    expected = sorted((CONFIG.parent).glob("*.yaml"))
    assert lines == [f"{p.stem}  {p}" for p in expected]
    assert len(lines) >= 4
