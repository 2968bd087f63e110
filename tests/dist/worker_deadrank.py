"""One rank of a Trainer fit under Lightning's own launcher SIGKILLs itself, or sleeps, at a step.

``python worker_deadrank.py WORLD DEAD_RANK STEP MODE [LIVENESS_S]`` starts the other ranks itself
(Lightning's subprocess script launcher: this process is rank 0). ``MODE`` is ``kill`` (the rank
SIGKILLs itself at ``STEP``), ``raise`` (it raises ``ValueError``) or ``slow`` (it sleeps
``3 * LIVENESS_S`` in the training loop, then goes on: a slow but alive rank must not be named).
Every rank prints ``STEP-REACHED <rank> <time>`` at ``STEP`` so the test can time the detection.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import faulthandler
import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import RecordingLM, leave_together  # noqa: E402

from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402

faulthandler.register(signal.SIGUSR1, all_threads=True)
WORLD, DEAD, STEP, MODE = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
LIVENESS_S = float(sys.argv[5]) if len(sys.argv) > 5 else 30.0


class DyingLM(RecordingLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == STEP and batch_idx == STEP:
            print(f"STEP-REACHED {self.global_rank} {time.time():.3f}", flush=True)
            if self.global_rank == DEAD:
                if MODE == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif MODE == "raise":
                    raise ValueError("planted failure")
                elif MODE == "slow":
                    time.sleep(3 * LIVENESS_S)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    strategy = FoldedMoEStrategy(ep=2, rank_liveness_timeout_s=LIVENESS_S, timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=STEP + 3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(DyingLM())
    print(f"FIT-DONE {trainer.global_rank}", flush=True)
    leave_together()


if __name__ == "__main__":
    main()
