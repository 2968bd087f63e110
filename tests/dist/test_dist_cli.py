"""The YAML class_path form end to end: ``lightning-moe fit`` on 4 CPU ranks (Lightning launches them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import run_cli_fit

pytestmark = pytest.mark.dist


def test_cli_fit_with_tiny_moe_folded_yaml_on_4_cpu_ranks(tmp_path: Path) -> None:
    args = [
        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
        "--trainer.logger=false", "--data.init_args.max_bytes=20000", "--data.init_args.seq_len=32",
    ]  # fmt: skip
    out = run_cli_fit("tiny_moe_folded.yaml", args, tmp_path, timeout=240)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out, out[-3000:]
