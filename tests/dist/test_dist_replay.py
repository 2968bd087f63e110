"""RouterReplay under FoldedMoEStrategy on 4 gloo ranks: EP=2, and EP=4 with activation recompute.

Each rank records its own shard; the replay run (routers perturbed) must route the recorded ids
in every forward, including the recomputed forward of checkpointed blocks, and the routers
must still receive gradients. Both layouts run in the shared 4-rank job.
"""

from __future__ import annotations

import pytest
from _harness import Suite

pytestmark = pytest.mark.dist


@pytest.mark.suite4("replay:ep=2", "replay:ep=4+recompute")  # the shared 4-rank job (conftest.py)
def test_replay_forces_recorded_ids_on_every_rank_with_ep2_and_ep4_recompute(suite4: Suite) -> None:
    for part in ("replay:ep=2", "replay:ep=4+recompute"):
        suite4.check(part)
    out = suite4.job.output
    for spec, recompute in (("ep=2", False), ("ep=4", True)):
        forwards = 3 * 2 * 2 * (2 if recompute else 1)  # steps x micro-batches x layers (x forward + recompute)
        for rank in range(4):
            assert f"OK {spec} rank {rank} forwards={forwards}" in out, out[-3000:]
