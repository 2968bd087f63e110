"""Distributed checkpoints: identical resume, reshard on load, every expert id stored.

The worker (``worker_ckpt.py``, in the shared 4-rank job) trains with AdamW and a warm-up/
cosine schedule, accumulation 2 and clipping for 4 optimizer steps, checkpointing after steps 2
and 4; a fresh run resumed from step 2 must reproduce the continuous run's loss tail bit for bit.
The worker itself checks the resumed run's final parameters, loads the step-4 folder at TP1 with
the other EP degrees of {4, 2, 1} (same parameters, bit for bit) and reads every expert id back
from the folder's metadata.

The resume point is an optimizer-step boundary at an epoch end: Lightning does not checkpoint
accumulated gradients, and a plain DataLoader restarts an interrupted epoch from its first batch.
"""

from __future__ import annotations

import pytest
import torch

from _harness import Suite

pytestmark = pytest.mark.dist

LAYOUTS = ["tp=2,ep=4", "ep=2"]  # TP2·DP2 with EP4 (reshard to EP2, EP1); DP4 with EP2·EDP2 (to EP4, EP1)


@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.suite4(f"ckpt:{s}")) for s in LAYOUTS])
def test_resume_repeats_the_loss_tail_bitwise_and_the_checkpoint_reshards_on_load(suite4: Suite, spec: str) -> None:
    suite4.check(f"ckpt:{spec}")
    result = torch.load(suite4.out / f"ckpt_{spec}.pt")
    for rank, (continuous, resumed) in enumerate(result["losses"]):
        assert len(continuous) == 8 and len(resumed) == 4, (rank, continuous, resumed)  # 4 steps x 2 micro
        assert resumed == continuous[4:], f"rank {rank}: resumed {resumed} != continuous tail {continuous[4:]}"


@pytest.mark.suite4("ckpt:etp")
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_folder_or_file_saved_at_etp2_loads_bitwise_at_etp1_other_layouts_and_on_one_process(
    suite4: Suite, kind: str
) -> None:
    """Saved at tp2·ep2·etp2 as a DCP folder or one file; the worker loads it at tp2·ep2·etp1,
    tp1·ep4·etp1, tp1·ep2·etp1 (bitwise parameters, equal validation loss); here one process reads
    it whole, without a process group."""
    from lightning_moe.export import load_checkpoint

    suite4.check("ckpt:etp")
    result = torch.load(suite4.out / ("ckpt_etp.pt" if kind == "folder" else "ckpt_etp_file.pt"))
    state, hparams = load_checkpoint(result["folder"])
    assert set(state) == set(result["params"])
    for name, want in result["params"].items():
        assert torch.equal(state[name], want), (name, (state[name] - want).abs().max())
