"""A DCP checkpoint saved at W=4 PP2 x EP2 resumes training at PP2 x EP2, PP1 x EP4 and PP4 x EP1.

``worker_pipeline_ckpt.py`` (one torchrun job on 4 gloo ranks): a continuous 4-step run at PP2 x
EP2 (AdamW with warm-up/cosine schedule, accumulation 2, clipping, a resumable loader of 8 rows per
batch over all data ranks) checkpoints after steps 2 (mid-epoch) and 4. Fresh runs train on from
the step-2 folder at each layout. What is proven:

1. at every layout, the restored parameters, AdamW moments, step counts and learning rates are
   the continuous run's after step 2 *bit for bit* (each stage saved its own under the model's
   names; DCP reshards across the stage and the expert cut); the step-4 folder loaded for
   validation at PP1 x EP4 and PP4 x EP1 gives the continuous run's final parameters bit for bit;
2. at PP2 x EP2 (the saving layout) every batch loss after the resume and the final parameters are
   *bitwise* the continuous run's;
3. at PP1 x EP4 and PP4 x EP1 every rank's batch loss after the resume and the final parameters
   equal a one-process reference (:func:`_pipeline_models.phased_reference`) that runs steps 1-2
   as PP2 x EP2 does (dp 2, 4 rows per rank as 4 micro-batches) and steps 3-4 as the new layout
   does (PP1 x EP4: dp 4, 2 rows per rank in one forward; PP4 x EP1: dp 1, 8 rows as 4
   micro-batches), reading the samples the resumable loader deals: the rest of epoch 0 after the
   32 samples read before the save, then epoch 1, each batch the same 8 samples at every layout,
   split over the new data ranks. The continuous run is compared with the same reference first,
   so a failure after a resume is the resume's.

Bitwise equality holds only at the saving layout: another data-parallel degree sums the gradients
in another order, and at ``pp=1`` a rank routes its whole batch in one forward where the pipeline
routes each micro-batch (the switch aux loss of a micro-batch is not that of the batch). Hence the
tolerances of 3: the losses to rtol 1e-5 (atol 1e-6; they agree to ~3e-7); the parameters to rtol
1e-5 with atol 1e-5, a thousandth of the learning rate: AdamW divides each gradient element by its
own running RMS, so an element whose gradient is ~1e-7 turns float32 summation-order noise into an
update error of ~1e-4 of the learning rate; one of 61 984 elements moves 2e-6 from the reference
already in the continuous run, before any resume, and no other moves more than 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _harness import run_torchrun
from _pipeline_models import Phase, compare_phased
from lightning_moe.optimizer import OptimizerConfig

pytestmark = pytest.mark.dist

OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)  # the worker's
SAVED = Phase(steps=2, dp=2, rows=4, micro=4)  # steps 1-2 at PP2 x EP2, before the step-2 folder
AFTER_RESUME = {
    "pp1_ep4": Phase(steps=2, dp=4, rows=2, micro=1),
    "pp4_ep1": Phase(steps=2, dp=1, rows=8, micro=4),
}
RESUMED_AT_BATCH = 4  # batches before the step-2 folder (2 steps, accumulation 2)


def _compare(result: dict, phases: tuple[Phase, ...], first_batch: int, label: str) -> None:
    compare_phased(result, phases, OPTIMIZER, first_batch, label, loss_atol=1e-6, state_atol=1e-5)


def test_pipeline_checkpoint_resumes_training_at_pp2_pp1_and_pp4(tmp_path: Path) -> None:
    out = run_torchrun("worker_pipeline_ckpt.py", 4, [str(tmp_path)], timeout=300)
    assert "PIPELINE CKPT OK" in out, out[-4000:]  # the bitwise checks (1, 2) ran in the worker
    _compare(torch.load(tmp_path / "continuous.pt"), (SAVED, SAVED), 0, "continuous pp=2,ep=2")
    for name, phase in AFTER_RESUME.items():
        _compare(torch.load(tmp_path / f"{name}.pt"), (SAVED, phase), RESUMED_AT_BATCH, f"resumed at {name}")
