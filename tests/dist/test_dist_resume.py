"""A folded run on 2 gloo ranks (DP2·EP2), crashed mid-epoch and resumed, equals the uninterrupted run.

``worker_resume.py`` trains the tiny MoE model of ``tests/unit/_resume_run.py`` for 16 steps
(several epochs, validation every 5 steps, DCP checkpoints every 5), once straight through and once
stopped by an exception on every rank after step 13 and resumed from the step-10 checkpoint. Each
rank's loss at every step and the final parameters (and expert biases) must be bit-for-bit equal:
each DP rank resumes its own shard of the data at the saved position.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _harness import Suite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _resume_run import STEPS, read_losses  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.mark.suite2("resume:ep=2")
def test_crashed_folded_run_resumes_bitwise_on_each_dp_rank(suite2: Suite) -> None:
    suite2.check("resume:ep=2")
    root = suite2.out / "resume-ep=2"
    for rank in range(2):
        want, got = read_losses(root / "full", rank), read_losses(root / "crashed", rank)
        assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
        diff = {s: abs(want[s] - got[s]) for s in want if want[s] != got[s]}
        assert not diff, f"rank {rank}: losses differ at steps {sorted(diff)} (max {max(diff.values()):.3g})"
    states = torch.load(root / "states.pt")
    full, resumed = states["full"], states["resume"]
    assert full.keys() == resumed.keys() and any(k.endswith("expert_bias") for k in full)
    assert [k for k in full if not torch.equal(full[k], resumed[k])] == []
