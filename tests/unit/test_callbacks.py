"""The callbacks package: lazy exports, and all three MoE callbacks through LightningCLI.

The CLI test runs the shipped ``configs/tiny_moe_callbacks.yaml`` (class_path entries under
``trainer.callbacks``) for 3 steps, with paths moved into a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_moe import callbacks
from lightning_moe.callbacks.router_replay import load_shard
from lightning_moe.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_callbacks.yaml"


def test_package_exports_the_moe_callbacks_lazily() -> None:
    assert {"RouterReplay", "MoEMonitor", "ECHOExpertCloning"} <= set(callbacks.__all__)
    assert callbacks.RouterReplay.__name__ == "RouterReplay"
    with pytest.raises(AttributeError, match="NoSuchCallback"):
        callbacks.NoSuchCallback  # noqa: B018


def test_shipped_config_runs_all_three_callbacks_through_the_cli(tmp_path: Path) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    classes = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert classes == [
        "lightning_moe.callbacks.MoEMonitor",
        "lightning_moe.callbacks.RouterReplay",
        "lightning_moe.callbacks.ECHOExpertCloning",
    ]
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["trainer"]["callbacks"][0]["init_args"]["heatmap_every_n_steps"] = 3
    config["trainer"]["callbacks"][1]["init_args"]["path"] = str(tmp_path / "routes")
    config["data"]["init_args"].update(max_bytes=200_000, batch_size=2, seq_len=32)  # fast steps
    run_config = tmp_path / "config.yaml"
    run_config.write_text(yaml.safe_dump(config))
    with pytest.warns(UserWarning, match="ECHOExpertCloning: the MoE layers are not expert-parallel"):
        main(
            ["fit", "--config", str(run_config), "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
             "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
             "--trainer.enable_model_summary=false"]
        )  # fmt: skip
    version = tmp_path / "runs" / "tiny_moe_callbacks" / "version_0"
    header = (version / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"moe/expert_load_max_over_mean", "moe/router_entropy", "moe/load_balancing_loss"} <= set(header)
    assert (version / "moe_load" / "step00000003.png").is_file()
    shard = load_shard(tmp_path / "routes" / "rank00000-step000000000.pt")
    assert sorted(shard["steps"]) == [(0, 0), (1, 0), (2, 0)] and len(shard["layers"]) == 3
