"""Worker: a DCP checkpoint saved at PP2 x EP2 resumes bitwise and loads at PP1 x EP4 and PP4 x EP1, on 4 gloo ranks.

``python worker_pipeline_ckpt.py OUT_DIR``:

1. continuous run at ``pp=2, ep=2`` (1f1b, 4 micro-batches), AdamW with warm-up/cosine schedule,
   gradient accumulation 2 and clipping, 4 optimizer steps; ``ModelCheckpoint`` writes a DCP
   folder after steps 2 and 4 (each stage saves its own parameters under the model's names);
2. resumed run: a fresh model and Trainer at ``pp=2, ep=2`` continue from the step-2 folder;
   every batch loss and the final parameters must be *bitwise* the continuous run's;
3. reshard on load: the step-4 folder loads at ``pp=1, ep=4`` (``validate``, parameters zeroed
   first) and must give the continuous run's final parameters bit for bit, AdamW state included.
4. the same folder loads at ``pp=4, ep=1`` (one block per stage, each rank's stage holding every
   expert of its block; ``validate`` through the pipeline, parameters zeroed first) and must give
   the continuous run's final parameters bit for bit.

Rank 0 prints ``PIPELINE CKPT OK``.
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
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, CLIP, TokenData, leave_together
from _pipeline_models import BATCH, PipelineLM
from lightning_moe.lit import MoELanguageModel
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FoldedMoEStrategy

STEPS, RESUME_AT = 4, 2


class AdamPipelineLM(PipelineLM):
    def __init__(self) -> None:
        super().__init__()
        self.optimizer_config = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)

    def configure_optimizers(self) -> Any:
        return MoELanguageModel.configure_optimizers(self)


def _trainer(pp: int, ep: int, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    pipeline = {"pp_schedule": "1f1b", "pp_microbatches": 4} if pp > 1 else {}
    strategy = FoldedMoEStrategy(pp=pp, ep=ep, **pipeline, timeout=timedelta(seconds=90))
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP, logger=False, callbacks=callbacks or [], enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=RESUME_AT * ACCUM,
        limit_val_batches=1, num_sanity_val_steps=0,
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
        raise AssertionError(f"{what}: parameter names differ: {sorted(want.keys() ^ got.keys())[:5]}")
    bad = [name for name in want if not torch.equal(want[name], got[name])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} parameters differ, first {bad[0]}")


def main(out: Path) -> None:
    ckpt_dir = out / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=RESUME_AT, save_top_k=-1)  # fmt: skip
    cont = _fresh()
    _trainer(2, 2, [saver]).fit(cont)
    final = _full_state(cont)
    resumed = _fresh()
    _trainer(2, 2).fit(resumed, ckpt_path=ckpt_dir / f"step{RESUME_AT}.ckpt")
    tail = cont.recorded[RESUME_AT * ACCUM :]
    if resumed.recorded != tail:
        raise AssertionError(f"rank {dist.get_rank()}: resumed losses {resumed.recorded} != continuous {tail}")
    _check_equal(final, _full_state(resumed), "resumed at pp=2,ep=2")
    other = _fresh()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    val = DataLoader(TokenData(num_samples=8), batch_size=BATCH)
    _trainer(1, 4).validate(other, dataloaders=val, ckpt_path=ckpt_dir / f"step{STEPS}.ckpt", verbose=False)
    _check_equal(final, _full_state(other), "loaded at pp=1,ep=4")
    staged = _fresh()
    with torch.no_grad():
        for p in staged.parameters():
            p.zero_()
    _trainer(4, 1).validate(staged, dataloaders=val, ckpt_path=ckpt_dir / f"step{STEPS}.ckpt", verbose=False)
    _check_equal(final, _full_state(staged), "loaded at pp=4,ep=1")
    if dist.get_rank() == 0:
        print("PIPELINE CKPT OK", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    main(Path(sys.argv[1]))
    leave_together()
