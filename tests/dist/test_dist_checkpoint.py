"""Distributed checkpoints: every expert id stored, reshard EP4 -> EP2 -> EP1, identical resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_checkpoint_at_ep4_reloads_at_ep2_and_ep1_and_resumes_identically(tmp_path: Path) -> None:
    out = run_torchrun("worker_ckpt.py", 4, [str(tmp_path)], timeout=300)
    assert "CKPT OK" in out
