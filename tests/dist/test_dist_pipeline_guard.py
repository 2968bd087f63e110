"""The non-finite guard at W=2 PP2: an inf gradient on the last stage stops the step on both stages.

``worker_pipeline_guard.py`` writes +inf into one gradient of rank 1's stage after the pipeline's
backward; both ranks must raise the same ``FloatingPointError`` naming that parameter (held by
rank 1 only) and rank 1, with no parameter changed in the step.
"""

from __future__ import annotations

import pytest

from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_inf_gradient_on_one_stage_stops_the_step_on_every_stage() -> None:
    out = run_torchrun("worker_pipeline_guard.py", 2, [], timeout=240)
    assert "PIPELINE GUARD OK" in out and "model.layers.3.attn.o_proj.weight" in out, out[-4000:]
