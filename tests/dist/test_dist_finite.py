"""The non-finite guard on 2 gloo ranks under FoldedMoEStrategy(ep=2): FSDP2 and expert shards.

One rank's +inf in one expert-weight gradient makes every rank raise the same error, naming the
parameter and the rank, with no weight changed; with ``skip_nonfinite=1`` the step is skipped on
every rank and the run equals one that drops that step's gradients; under Fabric
(``FabricFoldedMoEStrategy(ep=2)``) ``optimizer.step()`` raises the same way (``worker_finite.py``).
"""

from __future__ import annotations

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_inf_in_one_ranks_expert_gradient_stops_or_skips_the_step_on_every_rank() -> None:
    out = run_torchrun("worker_finite.py", 2, [], timeout=400)
    assert "RAISE OK FoldedMoEStrategy: at step 2, before the optimizer step, the gradient of parameter " \
        "'model.layers.1.ffn.experts.w13' (module 'model.layers.1.ffn.experts', GroupedExperts) holds inf on rank 1" in out, out[-4000:]
    assert "SKIP OK" in out, out[-4000:]
    assert "FABRIC OK FabricFoldedMoEStrategy: at step 2, before the optimizer step, the gradient of parameter " \
        "'layers.1.ffn.experts.w13' (module 'layers.1.ffn.experts', GroupedExperts) holds inf on rank 1" in out, out[-4000:]
