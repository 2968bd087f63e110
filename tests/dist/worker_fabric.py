"""Worker: Fabric with the folded_moe strategy equals one process, like the Trainer tests.

``python worker_fabric.py OUT_DIR SPEC...`` on 4 ranks (or ``run(OUT_DIR, SPEC)`` from
``worker_suite.py``). ``SPEC`` is ``string`` — ``Fabric(strategy="folded_moe")``, the registered
name with default degrees (DP4, experts EP1·EDP4 on the fused local path), model and optimizer
through one ``fabric.setup(model, optimizer)`` call — or a layout like ``tp=2,ep=2,etp=2``: the
object form, ``fabric.setup(model)`` then ``fabric.setup_optimizers(...)``.

Each run trains ``STEPS`` optimizer steps of SGD with momentum, gradient accumulation 2
(``fabric.no_backward_sync``) and mesh-aware clipping (``fabric.clip_gradients``). Rank 0 writes
``OUT_DIR/fabric_<SPEC>.pt`` with every rank's (DP coordinate, micro-batch losses) and the final
full parameters, named as in the LightningModule (``model.<name>``).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, BATCH, CLIP, LR, RecordingLM, TokenData, leave_together
from lightning_moe.moe.utils import set_aux_loss_scale
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FabricFoldedMoEStrategy

STEPS = 2


def _parse(spec: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}


def run(out: Path, spec: str) -> None:
    if spec == "string":
        fabric = L.Fabric(accelerator="cpu", devices=4, strategy="folded_moe")
    else:
        strategy = FabricFoldedMoEStrategy(**_parse(spec), timeout=timedelta(seconds=90))
        fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    assert isinstance(fabric.strategy, FabricFoldedMoEStrategy), type(fabric.strategy)
    torch.manual_seed(0)
    lm = RecordingLM()  # the same initial weights as the one-process reference
    model = lm.model
    if spec == "string":  # one call: the strategy re-points the optimizer at the sharded parameters
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    else:
        model = fabric.setup(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    # shuffle=True: Fabric swaps in a DistributedSampler over the DP ranks (seed 0), as the reference
    loader = fabric.setup_dataloaders(DataLoader(TokenData(), batch_size=BATCH, shuffle=True))
    set_aux_loss_scale(model, 1.0 / ACCUM)
    batches = iter(loader)
    losses: list[float] = []
    for _ in range(STEPS):
        for micro in range(ACCUM):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                logits = model(batch["input_ids"])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
                fabric.backward(loss / ACCUM)
            losses.append(float(loss.detach()))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    state = {f"model.{k}": v for k, v in gather_full_state(model.module).items()}
    gathered = [None] * fabric.world_size
    dist.all_gather_object(gathered, (fabric.strategy.folded_mesh.rank("dp"), losses))
    if fabric.global_rank == 0:
        torch.save({"losses": gathered, "state": state}, out / f"fabric_{spec}.pt")
        print(f"DONE fabric {spec}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for spec in sys.argv[2:]:
        run(Path(sys.argv[1]), spec)
    leave_together()
