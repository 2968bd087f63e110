"""Worker: the same command restarted by torchrun after one rank dies resumes from ``last``.

``python -m torch.distributed.run --nproc_per_node=4 [--max-restarts=1] worker_autoresume.py OUT RUN``.
``RUN=full``: the uninterrupted run into ``OUT/full``. ``RUN=killed``: the same run into
``OUT/killed``, where rank 1 SIGKILLs itself after step ``KILL`` (after the step-``EVERY``
checkpoint) on the first attempt; torchrun stops the other ranks and starts the group again, and
the same command's ``fit(ckpt_path="last")`` now finds the newest complete checkpoint (on the first
attempt it found none and started fresh). Rank 0 writes ``OUT/<run>.pt``
with the final full parameters, expert biases and per-step losses. Folded layout TP2·DP2 with
EP4 over 4 gloo ranks; the data position comes back from the checkpoint (mid-epoch resume).
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _models import leave_together  # noqa: E402
from _resume_run import BATCH, SEQ, model_config  # noqa: E402

import lightning_moe  # noqa: F401, E402
from lightning_moe.data import MoEDataModule  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.parallel.checkpoint import gather_full_state  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402

STEPS, EVERY, KILL = 10, 4, 6


class _Losses(Callback):
    def __init__(self, kill: bool) -> None:
        self.kill, self.losses = kill, {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])
        if self.kill and trainer.global_rank == 1 and trainer.global_step == KILL:
            os.kill(os.getpid(), signal.SIGKILL)


def run(out: Path, kill: bool) -> None:
    pl.seed_everything(1234, workers=True)
    model = MoELanguageModel(model_config(), learning_rate=3e-3, warmup_steps=3, log_layer_load=False)
    data = MoEDataModule(seq_len=SEQ, batch_size=BATCH, max_bytes=520, val_fraction=0.05, seed=7)
    losses = _Losses(kill)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=FoldedMoEStrategy(tp=2, ep=4, timeout=timedelta(seconds=60)),
        max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0, logger=False,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=EVERY, save_last=True), losses],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    state = gather_full_state(model)
    state.update({k: b.detach().clone() for k, b in model.named_buffers() if k.endswith("expert_bias")})
    if trainer.global_rank == 0:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        torch.save({"state": state, "losses": losses.losses, "restarts": restarts}, out.with_suffix(".pt"))


def main(out: Path, which: str) -> None:
    torch.set_num_threads(1)
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    run(out / which, kill=which == "killed" and first_attempt)
    leave_together()  # a rank reaching interpreter exit while another still uses the group aborts in gloo


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
