"""The one-device Trainer, model and data of the checkpoint tests.

``checkpoint_trainer(out, steps)`` trains on the CPU with ``folded_moe`` on one device (or the
``strategy`` given) for ``steps`` optimizer steps without validation, and a ``ModelCheckpoint``
saves into ``out`` every 2 steps, keeping every checkpoint and ``last.ckpt``. ``tiny_model()`` is
the seeded tiny MoE model of ``_resume_run.py``; ``tiny_data()`` its byte-level data.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from _resume_run import model_config  # noqa: E402

import lightning_moe  # noqa: F401, E402 - registers "folded_moe"
from lightning_moe.data import MoEDataModule  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402

__all__ = ["checkpoint_trainer", "folded", "model_config", "tiny_data", "tiny_model"]


def folded(**kwargs: Any) -> FoldedMoEStrategy:
    """``folded_moe`` on one device; ``kwargs`` go to ``FoldedMoEStrategy``."""
    return FoldedMoEStrategy(timeout=timedelta(seconds=60), **kwargs)


def checkpoint_trainer(out: Path, steps: int, strategy: Any = None) -> pl.Trainer:
    """A CPU Trainer of ``steps`` steps saving every 2 steps into ``out`` (``folded()`` by default)."""
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=folded() if strategy is None else strategy, max_steps=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, callbacks=[ckpt], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def tiny_model() -> MoELanguageModel:
    torch.manual_seed(0)
    return MoELanguageModel(model_config(), warmup_steps=1, log_layer_load=False)


def tiny_data() -> MoEDataModule:
    return MoEDataModule(seq_len=16, batch_size=4, max_bytes=520, val_fraction=0.05, seed=7)
