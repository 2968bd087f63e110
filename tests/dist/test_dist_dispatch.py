"""AllToAll / AllGather dispatchers against LocalDispatcher on 4 gloo ranks (uneven, empty experts).

One torchrun launch runs every case (process start-up dominates on 2 cores).
"""

from __future__ import annotations

import pytest

from _harness import run_torchrun

pytestmark = pytest.mark.dist

CASES = ["alltoall:1:4:1", "allgather:1:4:1", "alltoall:2:2:2", "allgather:2:2:2", "alltoall:2:4:1"]


def test_dispatch_matches_local_with_uneven_splits_empty_experts_and_etp() -> None:
    """Outputs, input/weight gradients and expert gradients equal a one-process run (fp64)."""
    out = run_torchrun("worker_dispatch.py", 4, CASES, timeout=180)
    for case in CASES:
        kind, tp, ep, etp = case.split(":")
        assert f"OK {kind} tp={tp} ep={ep} etp={etp}" in out
