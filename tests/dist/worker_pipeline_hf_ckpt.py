"""Worker: DCP checkpoints of a swapped Hugging Face Qwen3-MoE at pp=2, on 2 gloo ranks.

``python worker_pipeline_hf_ckpt.py OUT_DIR``:

1. continuous run at ``pp=2`` (1f1b, 2 micro-batches) for 2 optimizer steps, one an epoch (a resume
   starts at an epoch boundary); ``ModelCheckpoint`` writes a DCP folder after each step;
2. resumed run: a fresh model and Trainer at ``pp=2`` continue from the step-1 folder; every batch
   loss and the final parameters must be bitwise the continuous run's;
3. the step-2 folder loads at ``pp=1`` (``dp=2``; ``validate``, parameters zeroed first) with the
   continuous run's final parameters bit for bit (the stages save under the whole HF model's
   names); a ``pp=1`` run resumed from the step-1 folder (the SGD momentum loaded across the degrees) saves a
   folder that loads at ``pp=2`` with that run's parameters;
4. rank 0 writes the continuous run's final parameters (HF names) to ``OUT_DIR/final.pt``, which
   the export of the step-2 folder must hold (the test exports it, without a process group).

Rank 0 prints ``HF PIPELINE CKPT OK``.
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

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import leave_together
from _pipeline_hf_models import HFRecordingLM, model_names
from lightning_moe.strategies import FoldedMoEStrategy

STEPS, RESUME_AT = 2, 1


def _trainer(pp: int, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    pipeline = {"pp_schedule": "1f1b", "pp_microbatches": 2} if pp > 1 else {}
    strategy = FoldedMoEStrategy(pp=pp, **pipeline, timeout=timedelta(seconds=90))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, callbacks=callbacks or [],
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        limit_train_batches=RESUME_AT, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=None,
    )  # fmt: skip


def _fresh() -> HFRecordingLM:
    torch.manual_seed(0)
    return HFRecordingLM()


def _full_state(lm: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every stage's parameters under the HF model's names, gathered onto every rank."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, model_names(lm.model))
    return {k: v for s in states for k, v in s.items()}


def _check_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    if want.keys() != got.keys():
        raise AssertionError(f"{what}: parameter names differ: {sorted(want.keys() ^ got.keys())[:5]}")
    bad = [name for name in want if not torch.equal(want[name], got[name])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} parameters differ, first {bad[0]}")


def _loaded(pp: int, path: Path) -> dict[str, torch.Tensor]:
    """A fresh model with every parameter zeroed, then ``path`` loaded at ``pp`` (``validate``)."""
    lm = _fresh()
    with torch.no_grad():
        for p in lm.parameters():
            p.zero_()
    _trainer(pp).validate(lm, ckpt_path=path, verbose=False)
    return _full_state(lm)


def main(out: Path) -> None:
    ckpt_dir = out / "ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=RESUME_AT, save_top_k=-1)  # fmt: skip
    cont = _fresh()
    _trainer(2, [saver]).fit(cont)
    final = _full_state(cont)
    resumed = _fresh()
    _trainer(2).fit(resumed, ckpt_path=ckpt_dir / f"step{RESUME_AT}.ckpt")
    tail = cont.recorded[RESUME_AT:]
    if resumed.recorded != tail:
        raise AssertionError(f"rank {dist.get_rank()}: resumed losses {resumed.recorded} != continuous {tail}")
    _check_equal(final, _full_state(resumed), "resumed at pp=2")
    _check_equal(final, _loaded(1, ckpt_dir / f"step{STEPS}.ckpt"), "pp=2 folder loaded at pp=1")
    whole_dir = out / "ckpt_pp1"
    saver1 = ModelCheckpoint(dirpath=whole_dir, filename="step{step}", auto_insert_metric_name=False,
                             every_n_train_steps=RESUME_AT, save_top_k=-1)  # fmt: skip
    whole = _fresh()
    _trainer(1, [saver1]).fit(whole, ckpt_path=ckpt_dir / f"step{RESUME_AT}.ckpt")  # optimizer state across pp too
    _check_equal(_full_state(whole), _loaded(2, whole_dir / f"step{STEPS}.ckpt"), "pp=1 folder loaded at pp=2")
    if dist.get_rank() == 0:
        torch.save(final, out / "final.pt")
        print("HF PIPELINE CKPT OK", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    main(Path(sys.argv[1]))
    leave_together()
