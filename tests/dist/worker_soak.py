"""Worker: a 500-step soak of the folded layout (tp2, ep4, the default dispatcher) with RSS sampled.

Run by ``test_dist_soak.py`` under torchrun (gloo, 4 ranks). The tiny model of ``_models.py``
trains with the default optimizer, a CSV logger and the per-layer load logging, over several epochs
of a small dataset. Every rank reads its resident set size (``/proc/self/statm``) after step
``SAMPLE_AT`` and at the end; rank 0 prints one ``RSS rank=... at=... end=... growth=...%`` line
per rank and ``SOAK OK`` with the last loss.
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
from lightning_moe.strategies import FoldedMoEStrategy

STEPS, SAMPLE_AT = 500, 100
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class SoakLM(MoELanguageModel):
    def train_dataloader(self) -> DataLoader:  # 100 steps per epoch on each of the 2 data-parallel ranks
        return DataLoader(TokenData(num_samples=400), batch_size=2, shuffle=True)


class RSSSampler(pl.Callback):
    def __init__(self) -> None:
        self.at: int | None = None
        self.end: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == SAMPLE_AT and self.at is None:
            self.at = rss_bytes()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = rss_bytes()


def main(out: Path) -> None:
    torch.manual_seed(0)
    sampler = RSSSampler()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FoldedMoEStrategy(tp=2, ep=4),
        max_steps=STEPS, gradient_clip_val=1.0, logger=CSVLogger(out, name="soak"), log_every_n_steps=10,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[sampler],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(SoakLM(model_config(), warmup_steps=20))
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
    main(Path(sys.argv[1]))
    leave_together()
