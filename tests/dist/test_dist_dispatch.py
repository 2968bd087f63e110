"""AllToAll / AllGather / flex (DeepEP and Hybrid-EP stand-ins) dispatchers against LocalDispatcher on 4 gloo ranks (uneven, empty experts).

Every case runs in the shared 4-rank job (``conftest.py``); the worker compares outputs
and gradients itself (fp64) and reports the case done.
"""

from __future__ import annotations

import pytest

from _harness import Suite

pytestmark = pytest.mark.dist

CASES = [
    "alltoall:1:4:1", "allgather:1:4:1", "alltoall:2:2:2", "allgather:2:2:2", "alltoall:2:4:1",
    "dedup:1:4:1", "dedup:2:4:1", "dedup:2:2:2", "deepep:1:4:1", "deepep:2:4:1", "deepep:2:2:2",
    "hybridep:1:4:1", "hybridep:2:4:1",
]  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.suite4(f"dispatch:{c}")) for c in CASES])
def test_dispatch_matches_local_with_uneven_splits_empty_experts_and_etp(suite4: Suite, case: str) -> None:
    """Outputs, input/weight gradients and expert gradients equal a one-process run (fp64)."""
    suite4.check(f"dispatch:{case}")
