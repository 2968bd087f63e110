"""Trainer.fit with FoldedMoEStrategy at pp > 1 equals one process: every logged loss, the final parameters.

``worker_pipeline_fit.py`` trains a 4-block model (1 dense, 3 MoE; switch aux loss and z-loss)
for 3 optimizer steps with gradient accumulation 2 and gradient clipping, fp32, batches of 4 rows
as 4 micro-batches, then validates through the pipeline (the logged ``val/loss`` against the
reference's final parameters). The reference (``_pipeline_models``) is
one process running the same micro-batches. W=2: PP2 with 1f1b, and gpipe over 2 micro-batches
without accumulation (the Trainer zeroes gradients between the training step and its backward,
after the pipeline's backward ran). W=4: PP2 x EP2 (dp 2) with 1f1b, interleaved 1f1b over 4
stages (2 per rank; with ``recompute=["moe"]``: the MoE layers' forwards run again in the
backward, between the schedule's micro-batches) and the zero-bubble
"V" schedules (zbv with the routers' aux-loss-free expert bias, stepped after every optimizer step
from the tokens of both data ranks, and compared like a parameter; dualpipev); PP2 x TP2 with each
stage's experts EP2 over its two TP ranks; PP2 x EP2 on packed documents (``document_ids`` reach
every stage, which restarts RoPE and masks attention per document); PP2 x TP2 with sequence
parallel and ETP2 (the hidden states travel ``[b, S/2, H]`` between the stages); PP2 x EP2 with
1f1b without clipping (``clip=0``: a wrong overall gradient scale, of the token loss or of the aux
losses, reaches the parameters instead of being clipped away) on labels with holes (``ignore=1``:
the data ranks' batches hold different counts of labelled tokens, some one-row micro-batches none,
so each micro-batch's token sum must be divided by the labelled tokens of the whole batch over
every data rank). W=8: PP2 x CP2 x TP2 with EP4 (each CP rank's load-balanced chunks and their
global positions through every stage; the mean of the ranks of one data rank is compared, each CP
rank logging its chunks' share). Every rank's logged batch losses, the logged ``train/loss``, the
logged MoE statistics (aux losses and per-layer load imbalance of the whole model over the
micro-batches; layouts without CP or sequence parallel, where each rank routes whole
sequences) and every parameter must match to rtol 1e-5. After the fit, ``trainer.predict`` through
the pipeline gives every rank the logits one process computes with the final parameters (batches of
4 rows whose last is shorter than the micro-batch count); under CP it is refused. FSDP2 reduces
each module's gradients once per optimizer step (3 per module), not once per micro-batch or
accumulated batch. One torchrun job per world size. ``LIGHTNING_MOE_TEST_ACCELERATOR=gpu`` runs the
workers on one GPU per rank over NCCL, compared at ``LIGHTNING_MOE_PARITY_RTOL`` (``bash
benchmarks/h200.sh multi``: the W=2 cases).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _harness import Launch, launch_torchrun, selected_tests
from _pipeline_models import PipelineLM, compare, make_data, mean_per_data_rank, packed, parse, recipe

pytestmark = pytest.mark.dist

SPECS = {
    2: ["pp=2,schedule=1f1b,n=4", "pp=2,schedule=gpipe,n=2,accum=1"],
    4: [
        "pp=2,ep=2,schedule=1f1b,n=4", "pp=2,ep=2,schedule=interleaved_1f1b,v=2,n=4,recompute=moe",
        "pp=2,ep=2,schedule=zbv,v=2,n=4,bias=1",
        "pp=2,ep=2,schedule=dualpipev,v=2,n=4", "pp=2,tp=2,ep=2,schedule=1f1b,n=4",
        "pp=2,ep=2,schedule=1f1b,n=4,packed=1", "pp=2,tp=2,etp=2,sp=1,schedule=1f1b,n=4",
        "pp=2,ep=2,schedule=1f1b,n=4,clip=0,ignore=1",
    ],
    8: ["pp=2,cp=2,tp=2,ep=4,schedule=1f1b,n=4"],
}
_CASES = [(world, spec) for world, specs in SPECS.items() for spec in specs]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Launch]]:
    return {"root": tmp_path_factory.mktemp("pipeline_fit")}  # type: ignore[dict-item]


def _job(jobs: dict, world: int, selected: list[str]) -> tuple[Path, Launch]:
    if world not in jobs:
        out = jobs["root"] / f"w{world}"
        out.mkdir()
        jobs[world] = (out, launch_torchrun("worker_pipeline_fit.py", world, [str(out), *selected], timeout=570))
    return jobs[world]


@pytest.mark.parametrize(("world", "spec"), _CASES, ids=[f"W{w}-{s}" for w, s in _CASES])
def test_trainer_pipeline_equals_one_process(jobs: dict, request: pytest.FixtureRequest, world: int, spec: str) -> None:
    selected = [s for w, s in _CASES if w == world and _selected(request, w, s)]
    out, job = _job(jobs, world, selected)
    if f"DONE {spec}" not in job.output:
        pytest.fail(f"worker_pipeline_fit {spec!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    result = torch.load(out / f"{spec}.pt")
    layout = parse(spec)
    dp = world // (layout["pp"] * layout.get("tp", 1) * layout.get("cp", 1))
    assert result["val_loss"] is not None, "no validation loss was logged"
    if layout.get("cp", 1) > 1:  # each CP rank's loss is its chunks' share: their mean is the batch's
        result = {**result, "losses": mean_per_data_rank(result["losses"])}
    rtol = float(os.environ.get("LIGHTNING_MOE_PARITY_RTOL", "1e-5"))  # looser on GPUs against the CPU reference
    compare(result, spec, dp, steps=3, rtol=rtol)  # the validation loss too, against the final reference parameters
    check_predictions(result, spec, rtol)
    for rank, (reductions, fsdp_modules) in enumerate(result["reductions"]):  # once per module and step
        assert fsdp_modules > 0 and reductions == 3 * fsdp_modules, (rank, reductions, fsdp_modules)


def check_predictions(result: dict, spec: str, rtol: float = 1e-5) -> None:
    """Every rank's ``trainer.predict`` logits equal one process's forward with the run's final
    parameters (``rtol``, atol ``rtol``), and the ranks of each data rank together cover every sample once per
    data rank; under CP every rank refused."""
    if parse(spec).get("cp", 1) > 1:
        for message in result["predictions"]:
            assert isinstance(message, str) and "predict at cp=2" in message, message
        return
    samples, seed = result["predict_data"]
    data = make_data(packed(spec), num_samples=samples, seed=seed)
    lm = PipelineLM(bias=recipe(spec).bias)
    lm.load_state_dict(result["state"], strict=False)
    batch = torch.utils.data.default_collate([data[i] for i in range(samples)])
    extra = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
    with torch.no_grad():
        want = lm.eval()(batch["input_ids"], **extra)
    seen: list[int] = []
    for rank, (indices, logits) in enumerate(result["predictions"]):
        torch.testing.assert_close(logits, want[indices], rtol=rtol, atol=rtol, msg=lambda m, r=rank: f"rank {r}: {m}")
        seen += indices
    assert sorted(set(seen)) == list(range(samples)), sorted(seen)


def _selected(request: pytest.FixtureRequest, world: int, spec: str) -> bool:
    """Whether the test of ``spec`` is in this run (a job runs only the selected layouts)."""
    wanted = f"W{world}-{spec}"
    return any(wanted in item.nodeid for item in selected_tests(request.config))
