"""Worker: Trainer.fit with FoldedMoEStrategy for several layouts in one torchrun job.

``python worker_fit.py OUT_DIR tp=2,ep=4 tp=1,ep=4 ...`` (or ``fit_one`` from
``worker_suite.py``; ``LIGHTNING_MOE_TEST_ACCELERATOR=gpu`` runs it on GPUs over NCCL): for each layout, 3 optimizer steps with gradient accumulation 2 and
clipping (``bf16=1`` in a layout: ``precision="bf16-mixed"``); rank 0 writes ``OUT_DIR/<layout>.pt`` with every rank's micro-batch losses, the DP
coordinate of each rank, the final full parameters and the ``train/loss`` value Lightning
logged last (a mean over the ranks).
"""

from __future__ import annotations

from typing import Any

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, CLIP, STEPS, RecordingLM, leave_together, model_config
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FoldedMoEStrategy


def parse(spec: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in spec.split(","):
        k, v = item.split("=")
        out[k] = v if k in ("dispatcher", "order") else int(v)
    return out


def _count_fused_accumulations() -> list[int]:
    """``fuse=1`` layouts: the tiny experts count as wide, and every in-place accumulation is counted."""
    import lightning_moe.ops.wgrad as wacc
    import lightning_moe.ops.wgrad.choice as wchoice

    calls: list[int] = []
    original = wacc.WgradFusion.accumulate_
    wchoice.wide_experts = lambda w2: True  # type: ignore[assignment]

    def counted(self: wacc.WgradFusion, *args: Any) -> None:
        calls.append(1)
        original(self, *args)

    wacc.WgradFusion.accumulate_ = counted  # type: ignore[method-assign]
    return calls


def fit_one(spec: str, out_dir: Path, world: int) -> None:
    torch.manual_seed(0)
    layout = parse(spec)
    fuse = bool(layout.pop("fuse", 0))  # MoEConfig(fuse_wgrad_accumulation=True)
    precision = "bf16-mixed" if layout.pop("bf16", 0) else "32-true"
    model = RecordingLM(model_config(fuse_wgrad_accumulation=True)) if fuse else RecordingLM()
    fused_calls = _count_fused_accumulations() if fuse else []
    strategy = FoldedMoEStrategy(**layout, timeout=timedelta(seconds=90))  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator=os.environ.get("LIGHTNING_MOE_TEST_ACCELERATOR", "cpu"), devices=world, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUM,
        precision=precision, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    state = {name: value.cpu() for name, value in gather_full_state(model).items()}
    losses = [None] * world
    dist.all_gather_object(losses, (strategy.folded_mesh.rank("dp"), model.recorded))
    logged = float(trainer.callback_metrics["train/loss"])  # the last micro-batch's, as logged
    if dist.get_rank() == 0:
        result = {"losses": losses, "state": state, "logged_loss": logged, "fused_calls": len(fused_calls)}
        torch.save(result, out_dir / f"{spec}.pt")
        print(f"DONE {spec}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    world = int(os.environ["WORLD_SIZE"])
    for spec in sys.argv[2:]:
        fit_one(spec, out, world)
    leave_together()
