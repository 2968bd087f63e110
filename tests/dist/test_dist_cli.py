"""The YAML class_path form end to end: ``lightning-moe fit`` on 4 CPU ranks (Lightning launches them)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def _entry() -> list[str]:
    """The console script; Lightning re-runs argv for ranks 1..3, so no ``python -c``."""
    script = shutil.which("lightning-moe")
    return [script] if script else [sys.executable, "-m", "lightning_moe.cli"]


def test_cli_fit_with_tiny_moe_folded_yaml_on_4_cpu_ranks(tmp_path: Path) -> None:
    cmd = [
        *_entry(), "fit",
        "--config", str(ROOT / "configs" / "tiny_moe_folded.yaml"),
        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
        "--trainer.logger=false", "--data.init_args.max_bytes=20000", "--data.init_args.seq_len=32",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"lightning-moe fit timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out, out[-3000:]
