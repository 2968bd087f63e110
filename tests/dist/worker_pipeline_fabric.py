"""Worker: Fabric with FabricFoldedMoEStrategy at pp > 1, several layouts in one torchrun job.

``python worker_pipeline_fabric.py OUT_DIR SPEC...`` (specs as ``_pipeline_models.parse``;
``packed=1``: packed documents). Each
trains ``STEPS`` optimizer steps: ``fabric.setup(transformer)`` gives this rank's stages, the
optimizer comes from ``fabric.setup_optimizers``, every batch goes through
``fabric.strategy.pipeline_step(batch, ACCUM)`` under ``fabric.no_backward_sync`` while
accumulating, then ``fabric.clip_gradients`` and the step. Rank 0 writes ``OUT_DIR/fabric_<spec>.pt``
with every rank's (dp coordinate, batch losses) and the final parameters of every stage.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, CLIP, LR, leave_together
from _pipeline_models import BATCH, PipelineLM, make_data, packed, parse
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FabricFoldedMoEStrategy

STEPS = 3


def run(out: Path, spec: str, world: int) -> None:
    strategy = FabricFoldedMoEStrategy(**parse(spec), timeout=timedelta(seconds=90))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(PipelineLM().model)  # the same initial weights as the one-process reference
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(make_data(packed(spec)), batch_size=BATCH, shuffle=True))
    batches = iter(loader)
    losses: list[float] = []
    for _ in range(STEPS):
        for micro in range(ACCUM):
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = strategy.pipeline_step(next(batches), ACCUM)
            losses.append(float(loss))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    state = {f"model.{k}": v for k, v in gather_full_state(strategy.pipeline.stages).items()}
    states = [None] * world
    dist.all_gather_object(states, state)
    everyone = [None] * world
    dist.all_gather_object(everyone, (strategy.folded_mesh.rank("dp"), losses))
    if dist.get_rank() == 0:
        merged = {k: v for s in states for k, v in s.items()}
        torch.save({"losses": everyone, "state": merged}, out / f"fabric_{spec}.pt")
        print(f"DONE {spec}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    out_dir = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        run(out_dir, spec, int(os.environ["WORLD_SIZE"]))
    leave_together()
