"""Fabric with FabricFoldedMoEStrategy at pp > 1 equals one process: every batch loss, the final parameters.

``worker_pipeline_fabric.py`` runs the Trainer test's model, data and arithmetic
(``_pipeline_models``: 3 optimizer steps, accumulation 2 through ``fabric.no_backward_sync``,
``fabric.clip_gradients``, fp32, 4 micro-batches of one row) with ``fabric.strategy.pipeline_step``
in place of the forward and ``fabric.backward``. W=2: PP2 with 1f1b; W=4: PP2 x EP2 with 1f1b,
zbv and interleaved 1f1b over 4 stages (2 per rank); PP2 x TP2 with sequence parallel and ETP2;
PP2 x EP2 on packed documents (``document_ids`` reach every stage); the swapped Hugging Face
Qwen3-MoE of the Trainer's HF test (``_pipeline_hf_models``, the HF model itself given to
``fabric.setup``) at PP2 x EP2 with 1f1b, its validation loss through ``pipeline.eval_step``
included; PP2 x EP2 with 1f1b without clipping on labels with holes (``clip=0,ignore=1``: the
gradients' overall scale reaches the parameters, and the data ranks' batches hold different
labelled-token counts, some one-row micro-batches none). W=8: PP2 x CP2 x TP2 with EP4, the whole
batch given to ``pipeline_step`` on every rank (the runner cuts it to this CP rank's load-balanced
chunks); each CP rank's loss is its chunks' share, so the mean of the ranks of one data rank is
compared. rtol 1e-5 against the one-process
reference. One torchrun job per world size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _harness import Launch, launch_torchrun, selected_tests
from _pipeline_hf_models import compare_hf, hf_spec
from _pipeline_models import compare, mean_per_data_rank, parse

pytestmark = pytest.mark.dist

SPECS = {
    2: ["pp=2,schedule=1f1b,n=4"],
    4: [
        "pp=2,ep=2,schedule=1f1b,n=4", "pp=2,ep=2,schedule=zbv,v=2,n=4", "pp=2,ep=2,schedule=interleaved_1f1b,v=2,n=4",
        "pp=2,tp=2,etp=2,sp=1,schedule=1f1b,n=4", "pp=2,ep=2,schedule=1f1b,n=4,packed=1",
        "hf,pp=2,ep=2,schedule=1f1b,n=4", "pp=2,ep=2,schedule=1f1b,n=4,clip=0,ignore=1",
    ],
    8: ["pp=2,cp=2,tp=2,ep=4,schedule=1f1b,n=4"],
}
_CASES = [(world, spec) for world, specs in SPECS.items() for spec in specs]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("pipeline_fabric")}


def _job(jobs: dict, world: int, specs: list[str]) -> tuple[Path, Launch]:
    if world not in jobs:
        out = jobs["root"] / f"w{world}"
        out.mkdir()
        jobs[world] = (out, launch_torchrun("worker_pipeline_fabric.py", world, [str(out), *specs], timeout=570))
    return jobs[world]


@pytest.mark.parametrize(("world", "spec"), _CASES, ids=[f"W{w}-{s}" for w, s in _CASES])
def test_fabric_pipeline_equals_one_process(jobs: dict, request: pytest.FixtureRequest, world: int, spec: str) -> None:
    is_hf, layout_spec = hf_spec(spec)
    if is_hf:
        pytest.importorskip("transformers")
    items = [item.nodeid for item in selected_tests(request.config)]
    selected = [s for w, s in _CASES if w == world and any(f"W{w}-{s}" in node for node in items)]
    out, job = _job(jobs, world, selected)
    if f"DONE {spec}" not in job.output:
        pytest.fail(f"worker_pipeline_fabric {spec!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
    result = torch.load(out / f"fabric_{spec}.pt")
    layout = parse(layout_spec)
    dp = world // (layout["pp"] * layout.get("tp", 1) * layout.get("cp", 1))
    if is_hf:
        compare_hf(result, layout_spec, dp, steps=3)
        return
    if layout.get("cp", 1) > 1:  # each CP rank's loss is its chunks' share: their mean is the batch's
        result = {**result, "losses": mean_per_data_rank(result["losses"])}
    compare(result, spec, dp, steps=3, label=f"fabric {spec}")
