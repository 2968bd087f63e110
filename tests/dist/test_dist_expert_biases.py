"""Experts with biases and a clamped SwiGLU (gpt-oss's expert math) under EP2 and ETP2, on 2 gloo ranks.

Each step's output, input and routing-weight gradients and every expert weight and bias gradient
equal a one-process run of the same tokens (``worker_expert_biases.py`` checks them), on the
degenerate routings of ``worker_degenerate.py``. ETP2 checks that the down bias, split over its
columns, is added once to the reduced output. One torchrun job for all specs.
"""

from __future__ import annotations

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist

SPECS = ["alltoall:1:2:1:20", "dedup:1:2:1:20", "allgather:1:2:1:20", "alltoall:2:1:2:20", "dedup:2:1:2:20"]


def test_biased_experts_match_one_process_under_ep_and_etp() -> None:
    out = run_torchrun("worker_expert_biases.py", 2, SPECS, timeout=300)
    for spec in SPECS:
        kind, tp, ep, etp, steps = spec.split(":")
        assert f"OK {kind} tp={tp} ep={ep} etp={etp} steps={steps} " in out, f"{spec} did not finish:\n{out[-4000:]}"
