"""Worker: a soak of the folded layout (tp2, ep4, the default dispatcher) with RSS sampled.

``worker_soak.py OUT STEPS SAMPLE_AT STEPS_PER_EPOCH``, run by ``test_dist_soak.py`` under torchrun
(gloo, 4 ranks). The tiny model of ``_models.py`` trains ``STEPS`` optimizer steps with the default
optimizer, a CSV logger and the per-layer load logging, over epochs of ``STEPS_PER_EPOCH`` steps of a
small dataset (so the run crosses several epoch ends). Every rank reads its resident set size
(``/proc/self/statm``) after step ``SAMPLE_AT`` and at the end; rank 0 prints one
``RSS rank=... at=... end=... growth=...%`` line per rank and ``SOAK OK`` with the last loss.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _models import TokenData, leave_together, model_config
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_moe.lit import MoELanguageModel
from lightning_moe.models import TransformerConfig
from lightning_moe.strategies import FoldedMoEStrategy

BATCH_SIZE, DATA_PARALLEL = 2, 2  # tp2 x ep4 on 4 ranks: 2 data-parallel ranks
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class SoakLM(MoELanguageModel):
    def __init__(self, model: TransformerConfig, steps_per_epoch: int, **options: Any) -> None:
        super().__init__(model, **options)
        self.steps_per_epoch = steps_per_epoch

    def train_dataloader(self) -> DataLoader:  # steps_per_epoch steps on each data-parallel rank
        data = TokenData(num_samples=self.steps_per_epoch * BATCH_SIZE * DATA_PARALLEL)
        return DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)


class RSSSampler(pl.Callback):
    def __init__(self, sample_at: int) -> None:
        self.sample_at = sample_at
        self.at: int | None = None
        self.end: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.sample_at and self.at is None:
            self.at = rss_bytes()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = rss_bytes()


def main(out: Path, steps: int, sample_at: int, steps_per_epoch: int) -> None:
    torch.manual_seed(0)
    sampler = RSSSampler(sample_at)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FoldedMoEStrategy(tp=2, ep=4),
        max_steps=steps, gradient_clip_val=1.0, logger=CSVLogger(out, name="soak"), log_every_n_steps=10,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[sampler],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(SoakLM(model_config(), steps_per_epoch, warmup_steps=20))
    took = time.perf_counter() - start
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (dist.get_rank(), sampler.at, sampler.end))
    if dist.get_rank() == 0:
        for rank, at, end in rows:
            print(f"RSS rank={rank} at={at / 2**20:.1f}MiB end={end / 2**20:.1f}MiB growth={100 * (end - at) / at:.2f}%")
        loss = float(trainer.callback_metrics["train/loss"])
        print(f"SOAK OK steps={trainer.global_step} loss={loss:.4f} {took:.0f}s", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:5]))
    leave_together()
