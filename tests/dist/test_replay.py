"""RouterReplay under FoldedMoEStrategy on 4 gloo ranks: EP=2, and EP=4 with activation recompute.

Each rank records its own shard; the replay run (routers perturbed) must route the recorded ids
in every forward, including the recomputed forward of checkpointed blocks, and the routers
must still receive gradients. Both layouts share one torchrun launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_replay_forces_recorded_ids_on_every_rank_with_ep2_and_ep4_recompute(tmp_path: Path) -> None:
    out = run_torchrun("worker_replay.py", 4, [str(tmp_path), "ep=2", "ep=4+recompute"], timeout=300)
    for spec, recompute in (("ep=2", False), ("ep=4", True)):
        forwards = 3 * 2 * 2 * (2 if recompute else 1)  # steps x micro-batches x layers (x forward + recompute)
        for rank in range(4):
            assert f"OK {spec} rank {rank} forwards={forwards}" in out, out[-3000:]
