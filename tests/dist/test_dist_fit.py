"""Trainer.fit with FoldedMoEStrategy equals one process: every loss and the final parameters.

Each layout trains 3 optimizer steps with gradient accumulation 2 and gradient clipping, fp32.
The reference runs each DP shard as its own micro-batch (so per-rank router statistics and
aux losses match) and scales like DP averaging. The W=4 layouts share the session's 4-rank job,
the W=8 ones its 8-rank job (``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

from _models import compare_with_reference, reference
from _harness import Suite

pytestmark = pytest.mark.dist

W4 = ["ep=4", "ep=2", "tp=2,ep=4", "tp=2,ep=2,etp=2"]  # DP4·EP4; DP4·EP2·EDP2; TP2·DP2 EP4; TP2·DP2 ETP2·EP2
W8 = ["tp=2,ep=8", "tp=2,ep=4,etp=2"]  # TP2·DP4 EP8; TP2·DP4 ETP2·EP4
_W8_PARAMS = [pytest.param(s, marks=[pytest.mark.suite8(f"fit:{s}"), pytest.mark.slow]) for s in W8]


def _check(suite: Suite, spec: str, world: int) -> None:
    suite.check(f"fit:{spec}")
    result = torch.load(suite.out / f"{spec}.pt")
    dp = world // int(dict(kv.split("=") for kv in spec.split(",")).get("tp", 1))
    compare_with_reference(result, spec, dp)
    # train/loss is logged as the mean over ranks = the DP mean of the last micro-batch
    last = torch.tensor(reference(dp)[0][-1]).mean()
    torch.testing.assert_close(torch.tensor(result["logged_loss"]), last, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.suite4(f"fit:{s}")) for s in W4])
def test_folded_layout_on_4_ranks_matches_one_process(suite4: Suite, spec: str) -> None:
    _check(suite4, spec, 4)


@pytest.mark.suite4("fit:ep=1,fuse=1")
def test_fused_expert_wgrad_accumulation_under_fsdp2_matches_one_process(suite4: Suite) -> None:
    """DP4 with the experts FSDP2-sharded (EP1): MoEConfig(fuse_wgrad_accumulation=True) adds the
    second micro-batch's expert gradients into the unsharded .grad inside the GEMMs."""
    _check(suite4, "ep=1,fuse=1", 4)
    fused = torch.load(suite4.out / "ep=1,fuse=1.pt")["fused_calls"]
    assert fused > 0, "the in-place accumulation never ran: FSDP2 held no unsharded .grad to add into"


@pytest.mark.parametrize("spec", _W8_PARAMS)
def test_folded_layout_on_8_ranks_matches_one_process(suite8: Suite, spec: str) -> None:
    _check(suite8, spec, 8)
