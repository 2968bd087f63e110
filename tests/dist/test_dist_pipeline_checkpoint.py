"""A DCP checkpoint saved at W=4 PP2 x EP2 resumes bitwise and reshards to PP1 x EP4 and PP4 x EP1 on load.

``worker_pipeline_ckpt.py``: a continuous 4-step run (AdamW, warm-up/cosine, accumulation 2,
clipping) checkpoints after steps 2 and 4; a fresh run resumed from step 2 at PP2 x EP2 repeats
the loss tail and ends with the same parameters bit for bit; the step-4 folder loaded at PP1 x EP4
gives the continuous run's final parameters bit for bit, and so does the same folder loaded at
PP4 x EP1 (one block per stage; each stage saved its parameters under the model's names, so DCP
reshards them across both the stage and the expert cut). Resuming training at PP1 is not compared bitwise: one
process routes a whole batch where the pipeline routes each micro-batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_pipeline_checkpoint_resumes_bitwise_and_loads_at_pp1_and_pp4(tmp_path: Path) -> None:
    out = run_torchrun("worker_pipeline_ckpt.py", 4, [str(tmp_path)], timeout=300)
    assert "PIPELINE CKPT OK" in out, out[-4000:]
