"""Trainer.fit with FoldedMoEStrategy equals one process: every loss and the final parameters.

Each layout trains 3 optimizer steps with gradient accumulation 2 and gradient clipping, fp32.
The reference runs each DP shard as its own micro-batch (so per-rank router statistics and
aux losses match) and scales like DP averaging. All W=4 layouts share one torchrun launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _harness import run_torchrun
from _models import reference

pytestmark = pytest.mark.dist

W4 = ["ep=4", "ep=2", "tp=2,ep=4", "tp=2,ep=2,etp=2"]
W8 = ["tp=2,ep=8", "tp=2,ep=4,etp=2"]


def _compare(result: dict, spec: str, world: int) -> None:
    tp = int(dict(kv.split("=") for kv in spec.split(",")).get("tp", 1))
    dp = world // tp
    ref_losses, ref_state = reference(dp)
    for rank, (dp_rank, losses) in enumerate(result["losses"]):
        want = [row[dp_rank] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{spec} rank {rank} losses: {m}")  # fmt: skip
    assert set(result["state"]) == set(ref_state), spec
    for name, want in ref_state.items():
        torch.testing.assert_close(result["state"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{spec} {n}: {m}")  # fmt: skip


def test_folded_layouts_on_4_ranks_match_one_process(tmp_path: Path) -> None:
    """DP4·EP4; DP4·EP2·EDP2; TP2·DP2 with EP4; TP2·DP2 with ETP2·EP2."""
    run_torchrun("worker_fit.py", 4, [str(tmp_path), *W4], timeout=240)
    for spec in W4:
        _compare(torch.load(tmp_path / f"{spec}.pt"), spec, 4)


@pytest.mark.slow
def test_folded_layouts_on_8_ranks_match_one_process(tmp_path: Path) -> None:
    """TP2·DP4 with EP8; TP2·DP4 with ETP2·EP4 (8 CPU processes on 2 cores)."""
    run_torchrun("worker_fit.py", 8, [str(tmp_path), *W8], timeout=300)
    for spec in W8:
        _compare(torch.load(tmp_path / f"{spec}.pt"), spec, 8)
