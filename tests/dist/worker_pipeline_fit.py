"""Worker: Trainer.fit with FoldedMoEStrategy at pp > 1, several layouts in one torchrun job.

``python worker_pipeline_fit.py OUT_DIR SPEC...``; a spec is ``pp=2,ep=2,schedule=1f1b,v=1,n=4``
(``_pipeline_models.parse``). Each trains ``STEPS`` optimizer steps with gradient accumulation 2
and clipping, fp32 (``_pipeline_models.recipe``: ``accum=N``, N batches per step; ``packed=1``,
packed documents; ``ignore=1``, labels with holes; ``clip=0``, no clipping), and a validation pass
through the pipeline at the end. Rank 0 writes ``OUT_DIR/<spec>.pt``: every rank's (dp coordinate,
logged batch losses), the logged ``train/loss``, the validation loss, the final full parameters
gathered from every stage and, where each rank routes whole sequences (no CP, no sequence
parallel), every rank's logged MoE statistics of every batch (aux losses, per-layer load
imbalance), and every rank's ``trainer.predict`` output after the fit: ``(sample indices,
logits)``, or under CP the refusal's message; and every rank's count of FSDP2 gradient reductions
during the fit with its number of FSDP modules.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import leave_together
from _pipeline_models import PipelineLM, make_data, packed, parse, recipe
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FoldedMoEStrategy

STEPS = 3


VAL_DATA = (8, 7)  # validation samples and seed, stored with the result
PREDICT_DATA = (6, 11)  # predicted samples and seed
# "gpu": one GPU per rank over NCCL (``bash benchmarks/h200.sh multi``), against the same CPU reference
ACCELERATOR = os.environ.get("LIGHTNING_MOE_TEST_ACCELERATOR", "cpu")


class ValidatedLM(PipelineLM):
    """Validates at the end, and records every training batch's logged MoE statistics (aux losses,
    per-layer load imbalance)."""

    def __init__(self, packed: bool = False, ignore: bool = False, bias: bool = False, recompute: str = "") -> None:
        super().__init__(packed, ignore, bias, recompute)
        self.log_layer_load = True
        self.moe_logged: list[dict[str, float]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.moe_logged.append({})
        return super().training_step(batch, batch_idx)

    def log(self, name: str, value: object, *args: object, **kwargs: object) -> None:
        if self.training and name.startswith(("train/", "load_imbalance/")) and name not in ("train/loss", "train/ppl"):
            self.moe_logged[-1][name] = float(value)  # type: ignore[arg-type]
        super().log(name, value, *args, **kwargs)  # type: ignore[arg-type]

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        data = make_data(self.packed, self.ignore, num_samples=VAL_DATA[0], seed=VAL_DATA[1])
        return torch.utils.data.DataLoader(data, batch_size=4)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"index": batch["index"], "logits": super().predict_step(batch, batch_idx)}


class IndexedSamples(torch.utils.data.Dataset):
    """``PREDICT_DATA``'s samples, each with its ``index`` (the predictions name their samples)."""

    def __init__(self, packed: bool) -> None:
        self.data = make_data(packed, num_samples=PREDICT_DATA[0], seed=PREDICT_DATA[1])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**self.data[i], "index": torch.tensor(i)}


def predict(trainer: pl.Trainer, model: ValidatedLM, spec: str) -> Any:
    """``trainer.predict`` over ``PREDICT_DATA`` in batches of 4 (a loader's last batch shorter than the
    micro-batch count): this rank's ``(indices, logits)``; under CP the refusal's message instead."""
    loader = torch.utils.data.DataLoader(IndexedSamples(packed(spec)), batch_size=4)
    try:
        outputs = trainer.predict(model, dataloaders=loader)
    except ValueError as error:
        return str(error)
    return torch.cat([o["index"] for o in outputs]).tolist(), torch.cat([o["logits"].cpu() for o in outputs])


class ReductionCount:
    """Counts FSDP2's gradient reductions (its ``foreach_reduce``, one per parameter group and
    reducing backward) while active."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        self.module, self.calls = _fsdp_param_group, 0
        self._original = _fsdp_param_group.foreach_reduce

    def __enter__(self) -> "ReductionCount":
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._original(*args, **kwargs)

        self.module.foreach_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.foreach_reduce = self._original


def fit_one(spec: str, out_dir: Path, world: int) -> None:
    torch.manual_seed(0)
    run = recipe(spec)
    model = ValidatedLM(run.packed, run.ignore, run.bias, run.recompute)
    strategy = FoldedMoEStrategy(**parse(spec), timeout=timedelta(seconds=90))
    accum = run.accum
    trainer = pl.Trainer(
        accelerator=ACCELERATOR, devices=world, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accum,
        gradient_clip_val=run.clip or None, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1.0, val_check_interval=STEPS * accum,
    )  # fmt: skip
    with ReductionCount() as reductions:
        trainer.fit(model)
    fsdp_modules = sum(isinstance(m, FSDPModule) for m in model.model.modules())
    state = {f"model.{k}": v for k, v in gather_full_state(model.model).items()}
    # the routers' expert biases (buffers, the same on every rank of a stage) with run.bias
    state |= {f"model.{k}": v.detach().cpu().clone() for k, v in model.model.named_buffers() if k.endswith("expert_bias")}
    states = [None] * world
    dist.all_gather_object(states, state)
    merged = {k: v for s in states for k, v in s.items()}
    losses = [None] * world
    dist.all_gather_object(losses, (strategy.folded_mesh.rank("dp"), model.recorded))
    moe_logged = [None] * world
    dist.all_gather_object(moe_logged, (strategy.folded_mesh.rank("dp"), model.moe_logged))
    logged = float(trainer.callback_metrics["train/loss"])
    val = float(trainer.callback_metrics["val/loss"]) if "val/loss" in trainer.callback_metrics else None
    reduction_counts = [None] * world
    dist.all_gather_object(reduction_counts, (reductions.calls, fsdp_modules))
    predictions = [None] * world
    dist.all_gather_object(predictions, predict(trainer, model, spec))
    if dist.get_rank() == 0:
        result = {"losses": losses, "state": merged, "logged_loss": logged, "val_loss": val, "val_data": VAL_DATA}
        result |= {"predictions": predictions, "predict_data": PREDICT_DATA, "reductions": reduction_counts}
        if "cp" not in parse(spec) and not parse(spec).get("sequence_parallel"):  # else each rank routes a share
            result["moe_stats"] = moe_logged
        torch.save(result, out_dir / f"{spec}.pt")
        print(f"DONE {spec}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    out = Path(sys.argv[1])
    world = int(os.environ["WORLD_SIZE"])
    for spec in sys.argv[2:]:
        fit_one(spec, out, world)
    leave_together()
