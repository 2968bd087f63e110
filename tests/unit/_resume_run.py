"""One training run of the resume tests: full, killed at a step (SIGKILL), or resumed from a checkpoint.

``python _resume_run.py OUT_DIR MODE [STRATEGY]``; MODE is ``full``, ``kill=<step>`` (the process
SIGKILLs itself after that optimizer step, as a crash would) or ``resume`` (from
``OUT_DIR/ckpt/last.ckpt``). STRATEGY is ``auto`` (plain Trainer) or ``folded`` (``folded_moe``).
Each optimizer step's loss is appended to ``OUT_DIR/losses.txt`` as ``step loss.hex()`` (exact
float bits) and, at the end, the final parameters go to ``OUT_DIR/<MODE>.pt``. The data
are small enough that the run crosses epoch boundaries, validation runs every 10 steps, the LR has a
warm-up and a cosine decay, and the router has an expert bias, so all of those must resume exactly.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_moe  # noqa: F401 - registers "folded_moe"
from lightning_moe.config import MoEConfig
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig

__all__ = ["STEPS", "main", "model_config", "run"]

STEPS, EVERY, SEQ, BATCH = 30, 10, 16, 4


def model_config() -> TransformerConfig:
    moe = MoEConfig(
        hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss="switch", aux_loss_coeff=0.01,
        z_loss_coeff=1e-3, shared_expert_ffn_size=16, expert_bias=True,
    )  # fmt: skip
    return TransformerConfig(
        vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, moe=moe, num_dense_layers=1,
        dense_ffn_hidden_size=32, max_seq_len=SEQ,
    )  # fmt: skip


class _Record(Callback):
    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out, self.kill_at = out, kill_at

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            with (self.out / "losses.txt").open("a") as f:
                f.write(f"{trainer.global_step} {float(outputs['loss']).hex()}\n")
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def run(out: Path, mode: str, strategy: str = "auto", devices: int = 1, folded: dict[str, int] | None = None) -> dict:
    """Train; return the final parameters (full tensors on every rank)."""
    pl.seed_everything(1234, workers=True)
    kill_at = int(mode.split("=")[1]) if mode.startswith("kill=") else None
    model = MoELanguageModel(model_config(), learning_rate=3e-3, warmup_steps=5, log_layer_load=False)
    # 2400 bytes: 141 train windows of 16 -> 35 batches of 4 on one rank, 17 on each of 2.
    data = MoEDataModule(seq_len=SEQ, batch_size=BATCH, max_bytes=2_400, val_fraction=0.05, seed=7)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=EVERY, save_top_k=-1, save_last=True)
    if strategy == "folded":
        from datetime import timedelta

        from lightning_moe.strategies import FoldedMoEStrategy

        strat: Any = FoldedMoEStrategy(**(folded or {}), save_distributed_checkpoint=devices > 1,
                                       timeout=timedelta(seconds=90))  # fmt: skip
    else:
        strat = "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strat, max_steps=STEPS, val_check_interval=EVERY,
        limit_val_batches=2, num_sanity_val_steps=0, check_val_every_n_epoch=None, gradient_clip_val=1.0,
        logger=False, callbacks=[ckpt, _Record(out, kill_at)], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    # The checkpoint's hyper-parameters hold the config dataclasses, which weights_only loading refuses
    # unless allow-listed.
    with torch.serialization.safe_globals([MoEConfig, TransformerConfig]):
        trainer.fit(model, datamodule=data, ckpt_path=str(out / "ckpt" / "last.ckpt") if mode == "resume" else None)
    from lightning_moe.parallel.checkpoint import gather_full_state

    if strategy == "folded":
        state = {k: v.detach().cpu().clone() for k, v in gather_full_state(model).items()}
        state.update({k: b.detach().cpu().clone() for k, b in model.named_buffers() if k.endswith("expert_bias")})
        return state
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_losses(out: Path) -> dict[int, float]:
    """Step -> loss; a later line for the same step (the resumed run) replaces the earlier one."""
    losses: dict[int, float] = {}
    for line in (out / "losses.txt").read_text().split("\n"):
        if line:
            step, value = line.split()
            losses[int(step)] = float.fromhex(value)
    return losses


def main(argv: list[str]) -> None:
    out, mode = Path(argv[0]), argv[1]
    strategy = argv[2] if len(argv) > 2 else "auto"
    torch.set_num_threads(1)
    state = run(out, mode, strategy)
    torch.save(state, out / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
