"""Worker: a DCP checkpoint saved at W=4 PP2 x EP2 resumes training at PP2 x EP2, PP1 x EP4 and PP4 x EP1.

``python worker_pipeline_ckpt.py OUT_DIR`` (4 gloo ranks). Every run trains the same 4-block model
with AdamW and its warm-up/cosine schedule (``OptimizerConfig``), gradient accumulation 2 and
clipping, on a resumable loader (``ResumableDataLoader``) of ``GLOBAL_ROWS = 8`` rows per batch over
all data ranks: 4 per rank at PP2 x EP2 (dp 2, 4 micro-batches of 1 row), 2 per rank at PP1 x EP4
(dp 4, one forward per batch), 8 at PP4 x EP1 (dp 1, 4 micro-batches of 2 rows). An epoch is 6
batches (48 samples), 3 optimizer steps.

1. continuous run at ``pp=2, ep=2`` (1f1b), 4 optimizer steps; ``ModelCheckpoint`` writes a DCP
   folder after steps 2 (mid-epoch: 32 of 48 samples read) and 4; the parameters, AdamW moments,
   step counts and learning rates after step 2 are kept;
2. for each of ``pp=2, ep=2``, ``pp=1, ep=4`` and ``pp=4, ep=1``: a fresh model and Trainer train
   on from the step-2 folder. When training starts, every parameter, AdamW moment, step count and
   learning rate must be bit for bit the continuous run's after step 2 (each stage saved its own
   under the model's names; DCP reshards across the stage and the expert cut). The loader goes on
   with the next unseen samples of the global stream at the new data-parallel size (the rest of
   epoch 0, then epoch 1). At ``pp=2, ep=2`` every batch loss and the final parameters must be
   *bitwise* the continuous run's;
3. the step-4 folder loads at ``pp=1, ep=4`` and at ``pp=4, ep=1`` (``validate``, parameters zeroed
   first) and must give the continuous run's final parameters bit for bit.

Rank 0 writes ``continuous.pt``, ``pp2_ep2.pt``, ``pp1_ep4.pt``, ``pp4_ep1.pt`` (every rank's
``(dp_rank, batch losses)`` and the final parameters; the test compares the other layouts with the
one-process reference, which bitwise equality cannot be, see the test) and prints ``PIPELINE CKPT OK``.
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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, CLIP, TokenData, leave_together
from _pipeline_models import BATCH, PipelineLM
from lightning_moe.data.sampler import ResumableDataLoader, ResumableSampler
from lightning_moe.lit import MoELanguageModel
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FoldedMoEStrategy

STEPS, RESUME_AT = 4, 2
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)
GLOBAL_ROWS = 2 * BATCH  # rows of one batch over all data ranks: BATCH per rank at PP2 x EP2 (dp 2)
LAYOUTS = {"pp2_ep2": (2, 2), "pp1_ep4": (1, 4), "pp4_ep1": (4, 1)}  # (pp, ep) on 4 ranks


class AdamPipelineLM(PipelineLM):
    """``PipelineLM`` with the package's AdamW and schedule, reading a resumable loader of
    ``GLOBAL_ROWS / dp`` rows per data rank (the same global batch at every layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_config = OPTIMIZER

    def configure_optimizers(self) -> Any:
        return MoELanguageModel.configure_optimizers(self)

    def train_dataloader(self) -> DataLoader:
        shard = self.trainer.strategy.distributed_sampler_kwargs  # data-parallel size and rank
        data = self.train_data()
        sampler = ResumableSampler(data, num_replicas=shard["num_replicas"], rank=shard["rank"], seed=0)
        return ResumableDataLoader(data, sampler, batch_size=GLOBAL_ROWS // shard["num_replicas"])


class TrainingState(pl.Callback):
    """The training state (:func:`training_state`), taken once: after optimizer step ``after_step``
    or, with ``after_step=None``, when training starts (after a resume has restored it)."""

    def __init__(self, after_step: int | None = None) -> None:
        self.after_step = after_step
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.after_step is None:
            self.state = training_state(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.state and trainer.global_step == self.after_step:
            self.state = training_state(trainer, pl_module)


def training_state(trainer: pl.Trainer, lm: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every stage's parameters and their AdamW entries (moments, step count) as full tensors under
    the model's names, and the learning rate of each parameter group; the same dict on every rank."""
    optimizer = trainer.optimizers[0]
    mine = {f"param:{k}": v for k, v in gather_full_state(lm.model).items()}
    for name, p in lm.model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            mine[f"{key}:{name}"] = full.detach().cpu().clone()
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    merged = {k: v for s in states for k, v in s.items()}
    merged["lr"] = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    return merged


def _trainer(pp: int, ep: int, callbacks: list[pl.Callback], save: bool = False) -> pl.Trainer:
    pipeline = {"pp_schedule": "1f1b", "pp_microbatches": 4} if pp > 1 else {}
    strategy = FoldedMoEStrategy(pp=pp, ep=ep, **pipeline, timeout=timedelta(seconds=90))
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP, logger=False, callbacks=callbacks, enable_checkpointing=save,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1, num_sanity_val_steps=0,
    )  # fmt: skip


def _fresh() -> AdamPipelineLM:
    torch.manual_seed(0)
    return AdamPipelineLM()


def _full_state(lm: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every stage's parameters, gathered onto every rank (the model's names)."""
    mine = gather_full_state(lm.model)
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return {k: v for s in states for k, v in s.items()}


def _check_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    if want.keys() != got.keys():
        raise AssertionError(f"{what}: names differ: {sorted(want.keys() ^ got.keys())[:5]}")
    bad = [name for name in want if not torch.equal(want[name], got[name])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} tensors differ, first {bad[0]}")


def _save_result(out: Path, name: str, trainer: pl.Trainer, lm: AdamPipelineLM) -> dict[str, torch.Tensor]:
    """Rank 0 writes ``name.pt``: every rank's ``(dp_rank, batch losses)`` and the final parameters
    (``model.``-prefixed, as the reference names them). Returns the final parameters."""
    losses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (trainer.strategy.distributed_sampler_kwargs["rank"], lm.recorded))
    state = _full_state(lm)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": {f"model.{k}": v for k, v in state.items()}}, out / f"{name}.pt")
    return state


def _resume_training(out: Path, name: str, ckpt: Path, saved: dict[str, torch.Tensor]) -> AdamPipelineLM:
    """A fresh model and Trainer at layout ``name`` train on from ``ckpt``; what they restored must
    be ``saved`` bit for bit. The losses and final parameters go to ``name.pt``."""
    pp, ep = LAYOUTS[name]
    restored = TrainingState()
    lm = _fresh()
    trainer = _trainer(pp, ep, [restored])
    trainer.fit(lm, ckpt_path=ckpt)
    _check_equal(saved, restored.state, f"restored at pp={pp},ep={ep}")
    _save_result(out, name, trainer, lm)
    return lm


def _load_for_validation(pp: int, ep: int, ckpt: Path) -> dict[str, torch.Tensor]:
    """The parameters ``ckpt`` gives a model at ``pp, ep`` whose parameters were zeroed first."""
    lm = _fresh()
    with torch.no_grad():
        for p in lm.parameters():
            p.zero_()
    val = DataLoader(TokenData(num_samples=8), batch_size=BATCH)
    _trainer(pp, ep, []).validate(lm, dataloaders=val, ckpt_path=ckpt, verbose=False)
    return _full_state(lm)


def main(out: Path) -> None:
    ckpt_dir = out / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=RESUME_AT, save_top_k=-1)  # fmt: skip
    at_save = TrainingState(after_step=RESUME_AT)
    cont = _fresh()
    trainer = _trainer(2, 2, [saver, at_save], save=True)
    trainer.fit(cont)
    final = _save_result(out, "continuous", trainer, cont)
    step2 = ckpt_dir / f"step{RESUME_AT}.ckpt"
    resumed = _resume_training(out, "pp2_ep2", step2, at_save.state)
    tail = cont.recorded[RESUME_AT * ACCUM :]
    if resumed.recorded != tail:
        raise AssertionError(f"rank {dist.get_rank()}: resumed losses {resumed.recorded} != continuous {tail}")
    _check_equal(final, _full_state(resumed), "resumed at pp=2,ep=2")
    for name in ("pp1_ep4", "pp4_ep1"):
        _resume_training(out, name, step2, at_save.state)
    step4 = ckpt_dir / f"step{STEPS}.ckpt"
    _check_equal(final, _load_for_validation(1, 4, step4), "loaded at pp=1,ep=4")
    _check_equal(final, _load_for_validation(4, 1, step4), "loaded at pp=4,ep=1")
    if dist.get_rank() == 0:
        print("PIPELINE CKPT OK", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    main(Path(sys.argv[1]))
    leave_together()
