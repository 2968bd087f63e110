"""Trainer.fit of a swapped Hugging Face MoE model with FoldedMoEStrategy at pp > 1 equals one process.

``worker_pipeline_hf_fit.py`` trains a tiny random Qwen3-MoE (4 MoE decoder layers; switch aux loss
and z-loss; ``_pipeline_hf_models``) for 3 optimizer steps with gradient accumulation 2 and gradient
clipping, fp32, batches of 4 rows as 4 micro-batches, then validates through the pipeline. W=4:
PP2 x EP2 (dp 2) with 1f1b, the model cut into two stages of two HF decoder layers
(``models/hf_pipeline_stage.py``). Every rank's logged batch losses, the logged ``train/loss``, the
validation loss and every parameter (stage names mapped to the HF model's) must match the
one-process reference to rtol 1e-5. W=2: the model built on ``meta`` (PP2), whose stages must get
the rotary frequencies back after materialisation; DCP checkpoints at PP2 (``worker_pipeline_hf_ckpt.py``)
resume bitwise at pp=2, load at pp=1 and back (saved under the HF model's names), and export to an
HF directory holding the final parameters.
"""

from __future__ import annotations

import pytest
import torch

from _harness import launch_torchrun
from _pipeline_hf_models import MOE, compare_hf

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

SPEC = "pp=2,ep=2,schedule=1f1b,n=4"


def test_trainer_hf_pipeline_equals_one_process(tmp_path) -> None:
    job = launch_torchrun("worker_pipeline_hf_fit.py", 4, [str(tmp_path), SPEC], timeout=570)
    if f"DONE {SPEC}" not in job.output:
        pytest.fail(f"worker_pipeline_hf_fit {SPEC!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    result = torch.load(tmp_path / f"{SPEC}.pt")
    assert result["val_loss"] is not None, "no validation loss was logged"
    compare_hf(result, SPEC, dp=2, steps=3)


def test_trainer_hf_pipeline_of_a_meta_built_model_restores_the_rotary_frequencies(tmp_path) -> None:
    spec = "pp=2,schedule=1f1b,n=2,meta"
    job = launch_torchrun("worker_pipeline_hf_fit.py", 2, [str(tmp_path), spec], timeout=300)
    if f"DONE {spec}" not in job.output:
        pytest.fail(f"worker_pipeline_hf_fit {spec!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    ranks = torch.load(tmp_path / f"{spec}.pt")["ranks"]
    assert all(same for same, _ in ranks), "a stage's rotary frequencies differ from a fresh model's"
    losses = [loss for _, recorded in ranks for loss in recorded]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses


def test_hf_pipeline_checkpoint_resumes_reshards_across_pp_and_exports(tmp_path) -> None:
    job = launch_torchrun("worker_pipeline_hf_ckpt.py", 2, [str(tmp_path)], timeout=400)
    if "HF PIPELINE CKPT OK" not in job.output:
        pytest.fail(f"worker_pipeline_hf_ckpt did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    from transformers import AutoModelForCausalLM

    from lightning_moe.export import export_checkpoint
    from lightning_moe.models.hf import swap_moe_blocks

    export_checkpoint(tmp_path / "ckpt" / "step2.ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).float()
    got = dict(swap_moe_blocks(model, **MOE).named_parameters())
    want = torch.load(tmp_path / "final.pt")
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:5]
    for name, value in want.items():
        assert torch.equal(got[name].detach(), value), name
