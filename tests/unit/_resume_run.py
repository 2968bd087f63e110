"""One training run of the resume tests: full, killed at a step (SIGKILL), or resumed from a checkpoint.

``python _resume_run.py OUT_DIR MODES [STRATEGY]``; MODES is a comma-separated list of ``full``
(into ``OUT_DIR/full``), ``kill=<step>`` (the process SIGKILLs itself after that optimizer step, as
a crash would) and ``resume`` (from ``OUT_DIR/ckpt/last.ckpt``), run in order in one process.
STRATEGY is ``auto`` (plain Trainer) or ``folded`` (``folded_moe`` on one device); an optional
fourth argument sets the checkpoint and validation interval (default ``EVERY``). Each optimizer
step's loss is appended to ``losses.txt`` as ``step loss.hex()`` (exact float bits) and, at the
end, the final parameters (and expert biases) go to ``<mode>.pt``. The data
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

__all__ = ["KILL", "STEPS", "Crash", "main", "model_config", "read_losses", "run"]

STEPS, EVERY, KILL, SEQ, BATCH = 16, 5, 13, 16, 4


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
    def __init__(self, out: Path, kill_at: int | None, how: str) -> None:
        self.out, self.kill_at, self.how = out, kill_at, how

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        name = "losses.txt" if trainer.global_rank == 0 else f"losses.rank{trainer.global_rank}.txt"
        with (self.out / name).open("a") as f:
            f.write(f"{trainer.global_step} {float(outputs['loss']).hex()}\n")
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            if self.how == "raise":  # every rank at the same step, as a crash would stop them all
                raise Crash(f"crash after step {self.kill_at}")
            os.kill(os.getpid(), signal.SIGKILL)


class Crash(RuntimeError):
    """The simulated crash of ``raise=<step>``."""


def run(out: Path, mode: str, strategy: str = "auto", devices: int = 1, folded: dict[str, int] | None = None,
        every: int = EVERY) -> dict:  # fmt: skip
    """Train; return the final parameters (full tensors on every rank)."""
    pl.seed_everything(1234, workers=True)
    kill_at = int(mode.split("=")[1]) if mode.startswith(("kill=", "raise=")) else None
    model = MoELanguageModel(model_config(), learning_rate=3e-3, warmup_steps=5, log_layer_load=False)
    # 520 bytes: 30 train windows of 16 -> epochs of 7 batches of 4 on one rank, 3 on each of 2.
    data = MoEDataModule(seq_len=SEQ, batch_size=BATCH, max_bytes=520, val_fraction=0.05, seed=7)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1, save_last=True)
    if strategy == "folded":
        from datetime import timedelta

        from lightning_moe.strategies import FoldedMoEStrategy

        strat: Any = FoldedMoEStrategy(**(folded or {}), save_distributed_checkpoint=devices > 1,
                                       timeout=timedelta(seconds=90))  # fmt: skip
    else:
        strat = "auto"
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strat, max_steps=STEPS, val_check_interval=every,
        limit_val_batches=2, num_sanity_val_steps=0, check_val_every_n_epoch=None, gradient_clip_val=1.0,
        logger=False, callbacks=[ckpt, _Record(out, kill_at, mode.split("=")[0])], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    # The checkpoint's hyper-parameters hold the config dataclasses, which weights_only loading refuses
    # unless allow-listed (a DCP folder's metadata is read weights_only whatever fit is told).
    ckpt_path = str(out / "ckpt" / "last.ckpt") if mode == "resume" else None
    with torch.serialization.safe_globals(_config_classes()):
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=False)
    from lightning_moe.parallel.checkpoint import gather_full_state

    if strategy == "folded":
        state = {k: v.detach().cpu().clone() for k, v in gather_full_state(model).items()}
        state.update({k: b.detach().cpu().clone() for k, b in model.named_buffers() if k.endswith("expert_bias")})
        return state
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config_classes() -> list[type]:
    import dataclasses

    import lightning_moe.config as config

    found = [v for v in vars(config).values() if isinstance(v, type) and dataclasses.is_dataclass(v)]
    return [*found, TransformerConfig]


def read_losses(out: Path, rank: int = 0) -> dict[int, float]:
    """Step -> loss; a later line for the same step (the resumed run) replaces the earlier one."""
    losses: dict[int, float] = {}
    name = "losses.txt" if rank == 0 else f"losses.rank{rank}.txt"
    for line in (out / name).read_text().split("\n"):
        if line:
            step, value = line.split()
            losses[int(step)] = float.fromhex(value)
    return losses


def main(argv: list[str]) -> None:
    out, modes = Path(argv[0]), argv[1].split(",")
    strategy = argv[2] if len(argv) > 2 else "auto"
    every = int(argv[3]) if len(argv) > 3 else EVERY
    torch.set_num_threads(1)
    for mode in modes:
        where = out / "full" if mode == "full" else out
        where.mkdir(parents=True, exist_ok=True)
        state = run(where, mode, strategy, every=every)
        torch.save(state, where / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
