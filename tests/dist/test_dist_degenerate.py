"""Every expert-parallel dispatcher on hundreds of random skewed routings, on 4 gloo ranks.

Zipf-popular experts, one-hot router logits (every token on one expert), an EP rank whose experts
get no token, every slot dropped, and empty micro-batches on some ranks: outputs, input and
routing-weight gradients and expert-weight gradients equal a one-process run of the same tokens
(``worker_degenerate.py`` checks each step). One torchrun job for all dispatchers.
"""

from __future__ import annotations

import re

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist

STEPS = 200
SPECS = [f"{kind}:1:4:1:{STEPS}" for kind in ("alltoall", "allgather", "dedup", "deepep", "hybridep")]
# the folded recipe's layout (tp2, ep4) and expert tensor parallelism (etp2), fewer steps
SPECS += ["dedup:2:4:1:60", "alltoall:2:2:2:60", "dedup:2:2:2:60"]


def test_every_dispatcher_matches_one_process_on_degenerate_routings() -> None:
    out = run_torchrun("worker_degenerate.py", 4, SPECS, timeout=400)
    for spec in SPECS:
        kind, tp, ep, etp, steps = spec.split(":")
        line = re.search(rf"OK {kind} tp={tp} ep={ep} etp={etp} steps={steps} empty_shard=(\d+) empty_rank=(\d+)", out)
        assert line is not None, f"{spec} did not finish:\n{out[-4000:]}"
        # the routings did reach the degenerate cases on rank 0: empty shards and starved experts
        assert int(line.group(1)) > 0 and int(line.group(2)) > 0, line.group(0)
