"""Worker: Fabric with FabricFoldedMoEStrategy at pp > 1, several layouts in one torchrun job.

``python worker_pipeline_fabric.py OUT_DIR SPEC...`` (specs as ``_pipeline_models.parse``;
``packed=1``: packed documents; ``ignore=1``: labels with holes; ``clip=0``: no clipping,
``_pipeline_models.recipe``; a spec starting ``hf,``: the swapped Hugging Face Qwen3-MoE of
``_pipeline_hf_models`` in place of the ``MoETransformer``). Each trains ``STEPS`` optimizer steps:
``fabric.setup(model)`` gives this rank's stages, the optimizer comes from
``fabric.setup_optimizers``, every whole batch (under context parallel too: the runner cuts it
to this CP rank's chunks) goes through ``fabric.strategy.pipeline_step(batch, ACCUM)`` under
``fabric.no_backward_sync`` while accumulating, then ``fabric.clip_gradients`` (unless ``clip=0``)
and the step. Rank 0
writes ``OUT_DIR/fabric_<spec>.pt`` with every rank's (dp coordinate, batch losses) and the final
parameters of every stage (the HF model's names for ``hf,``, whose result also holds the last
batch's loss averaged over the ranks and the validation loss of ``pipeline.eval_step``).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, LR, TokenData, leave_together
from _pipeline_hf_models import VAL, HFRecordingLM, hf_spec, model_names
from _pipeline_models import BATCH, PipelineLM, make_data, parse, recipe
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FabricFoldedMoEStrategy

STEPS = 3


def run(out: Path, spec: str, world: int) -> None:
    is_hf, layout = hf_spec(spec)
    strategy = FabricFoldedMoEStrategy(**parse(layout), timeout=timedelta(seconds=90))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)  # the same initial weights as the one-process reference
    model = fabric.setup(HFRecordingLM().model if is_hf else PipelineLM().model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    run_recipe = recipe(layout)
    data = make_data(run_recipe.packed, run_recipe.ignore)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    losses = train(fabric, strategy, model, optimizer, iter(loader), run_recipe.clip)
    stages = strategy.pipeline.stages
    result: dict[str, Any] = {"state": model_names(stages) if is_hf else full_state(stages)}
    if is_hf:
        result["logged_loss"] = float(fabric.all_reduce(torch.tensor(losses[-1]), reduce_op="mean"))
        result["val_loss"] = validate(fabric, strategy, model)
    states = [None] * world
    dist.all_gather_object(states, result.pop("state"))
    everyone = [None] * world
    dist.all_gather_object(everyone, (strategy.folded_mesh.rank("dp"), losses))
    if dist.get_rank() == 0:
        merged = {k: v for s in states for k, v in s.items()}
        torch.save({**result, "losses": everyone, "state": merged}, out / f"fabric_{spec}.pt")
        print(f"DONE {spec}", flush=True)


def train(
    fabric: L.Fabric, strategy: FabricFoldedMoEStrategy, model: Any, optimizer: Any, batches: Any, clip: float
) -> list[float]:
    """``STEPS`` optimizer steps of ``ACCUM`` whole batches each, gradients clipped to ``clip``
    (0: not clipped); every batch's loss."""
    losses: list[float] = []
    for _ in range(STEPS):
        for micro in range(ACCUM):
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = strategy.pipeline_step(next(batches), ACCUM)
            losses.append(float(loss))
        if clip > 0:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def full_state(stages: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's stages' full parameters under the reference's names (``model.<name>``)."""
    return {f"model.{k}": v for k, v in gather_full_state(stages).items()}


def validate(fabric: L.Fabric, strategy: FabricFoldedMoEStrategy, model: Any) -> float:
    """The validation samples' token-mean loss: each data rank's batches through
    ``pipeline.eval_step`` (its share of the loss group's tokens), averaged over the ranks."""
    model.eval()
    data = TokenData(num_samples=VAL[0], seed=VAL[1])
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))
    mean = torch.stack([strategy.pipeline.eval_step(batch) for batch in loader]).mean()  # batches of equal tokens
    return float(fabric.all_reduce(mean, reduce_op="mean"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    out_dir = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        run(out_dir, spec, int(os.environ["WORLD_SIZE"]))
    leave_together()
