"""Fabric(strategy="folded_moe") on 4 gloo ranks equals one process, like the Trainer tests.

Two optimizer steps with gradient accumulation 2 (``no_backward_sync``) and mesh-aware
clipping, SGD with momentum, fp32: every rank's losses and the final parameters against the
one-process reference. ``string`` is the registered name with default degrees (DP4, experts
EP1·EDP4 on the fused local path) and ``fabric.setup(model, optimizer)`` in one call; the
layout is the object form with ``setup`` then ``setup_optimizers``.
"""

from __future__ import annotations

import pytest
import torch

from _harness import Suite
from _models import compare_with_reference

pytestmark = pytest.mark.dist

CASES = {"string": 4, "tp=2,ep=2,etp=2": 2}  # spec -> DP size


@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.suite4(f"fabric:{s}")) for s in CASES])
def test_fabric_folded_moe_on_4_ranks_matches_one_process(suite4: Suite, spec: str) -> None:
    suite4.check(f"fabric:{spec}")
    result = torch.load(suite4.out / f"fabric_{spec}.pt")
    compare_with_reference(result, f"fabric {spec}", CASES[spec], steps=2)
