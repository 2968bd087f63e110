"""Distributed checkpoints: identical resume, reshard TP2·EP4 -> TP1·EP2 -> TP1·EP1, every expert id.

The worker (``worker_ckpt.py``, in the session's 4-rank job) trains TP2·DP2 EP4 with AdamW,
accumulation 2 and clipping for 4 optimizer steps, checkpointing after steps 2 and 4; a fresh run
resumed from step 2 must reproduce the continuous run's loss tail bit for bit. It also checks the
final parameters of the resumed run and the parameters loaded at other layouts itself.
"""

from __future__ import annotations

import pytest
import torch

from _harness import Suite

pytestmark = pytest.mark.dist


@pytest.mark.suite4("ckpt")
def test_resume_repeats_the_loss_tail_and_a_tp2_ep4_checkpoint_loads_at_ep2_and_ep1(suite4: Suite) -> None:
    suite4.check("ckpt")
    result = torch.load(suite4.out / "ckpt.pt")
    for rank, (continuous, resumed) in enumerate(result["losses"]):
        assert len(continuous) == 8 and len(resumed) == 4, (rank, continuous, resumed)  # 4 steps x 2 micro
        assert resumed == continuous[4:], f"rank {rank}: resumed {resumed} != continuous tail {continuous[4:]}"
