"""Trainer.fit of a swapped Hugging Face MoE model with FoldedMoEStrategy at pp > 1 equals one process.

``worker_pipeline_hf_fit.py`` trains a tiny random Qwen3-MoE (4 MoE decoder layers; switch aux loss
and z-loss; ``_pipeline_hf_models``) for 3 optimizer steps with gradient accumulation 2 and gradient
clipping, fp32, batches of 4 rows as 4 micro-batches, then validates through the pipeline. W=4, in
one job, each with 1f1b and the model cut into two stages of two HF decoder layers
(``models/hf_pipeline_stage.py``): PP2 x EP2 (dp 2); PP2 x TP2 with sequence parallel and ETP2
(the first stage scatters its embedding output along the sequence, the hidden states travel
``[b, S/2, H]`` between the stages, the last stage gathers them before the head); PP2 x CP2 (each
CP rank's load-balanced chunks with their global ``position_ids`` reach every stage, whose
attention runs over the CP group; the mean of the CP ranks' losses is compared, each logging its
chunks' share); PP2 x EP2 on packed documents (``document_ids`` reach every stage, which restarts
the rotary positions and masks attention per document, in training and validation). Every rank's
logged batch losses, the logged ``train/loss``, the validation loss and every parameter (stage
names mapped to the HF model's) must match the one-process reference to rtol 1e-5; after the fit,
``trainer.predict`` through the stages gives every rank the logits of the whole model with the
final parameters (refused under CP). W=2: the model
built on ``meta`` (PP2), whose stages must get the rotary frequencies back after materialisation;
DCP checkpoints at PP2 (``worker_pipeline_hf_ckpt.py``) resume bitwise at pp=2, load at pp=1 and
back (saved under the HF model's names), and export to an HF directory holding the final
parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _harness import Launch, launch_torchrun, selected_tests
from _pipeline_hf_models import MOE, HFRecordingLM, compare_hf
from _pipeline_models import make_data, mean_per_data_rank, packed, parse

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

SPECS = [
    "pp=2,ep=2,schedule=1f1b,n=4", "pp=2,tp=2,etp=2,sp=1,schedule=1f1b,n=4", "pp=2,cp=2,schedule=1f1b,n=4",
    "pp=2,ep=2,schedule=1f1b,n=4,packed=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def w4_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Launch]:
    """One W=4 job for the selected layouts (tests chosen by node id run only theirs)."""
    chosen = {item.nodeid for item in selected_tests(request.config)}
    selected = [s for s in SPECS if any(f"[{s}]" in node for node in chosen)] or SPECS
    out = tmp_path_factory.mktemp("pipeline_hf_fit")
    return out, launch_torchrun("worker_pipeline_hf_fit.py", 4, [str(out), *selected], timeout=570)


@pytest.mark.parametrize("spec", SPECS, ids=SPECS)
def test_trainer_hf_pipeline_equals_one_process(w4_job: tuple[Path, Launch], spec: str) -> None:
    out, job = w4_job
    if f"DONE {spec}" not in job.output:
        pytest.fail(f"worker_pipeline_hf_fit {spec!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    result = torch.load(out / f"{spec}.pt")
    assert result["val_loss"] is not None, "no validation loss was logged"
    layout = parse(spec)
    if layout.get("cp", 1) > 1:  # each CP rank's loss is its chunks' share: their mean is the batch's
        result = {**result, "losses": mean_per_data_rank(result["losses"])}
    compare_hf(result, spec, dp=4 // (layout["pp"] * layout.get("tp", 1) * layout.get("cp", 1)), steps=3)
    check_hf_predictions(result, spec)


def check_hf_predictions(result: dict, spec: str) -> None:
    """Every rank's ``trainer.predict`` logits equal the whole HF model's forward with the run's final
    parameters (rtol 1e-5); every sample predicted; under CP every rank refused."""
    if parse(spec).get("cp", 1) > 1:
        assert all(isinstance(m, str) and "predict at cp=2" in m for m in result["predictions"]), result["predictions"]
        return
    samples, seed = result["predict_data"]
    data = make_data(packed(spec), num_samples=samples, seed=seed)
    lm = HFRecordingLM()
    missing, unexpected = lm.model.load_state_dict(result["state"], strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    batch = torch.utils.data.default_collate([data[i] for i in range(samples)])
    extra = {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}
    with torch.no_grad():
        want = lm.eval()(batch["input_ids"], **extra)
    seen: list[int] = []
    for rank, (indices, logits) in enumerate(result["predictions"]):
        torch.testing.assert_close(logits, want[indices], rtol=1e-5, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")
        seen += indices
    assert sorted(set(seen)) == list(range(samples)), sorted(seen)


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
