"""A Trainer fit under Lightning's own launcher where one rank stalls, then SIGKILLs itself.

``python worker_deadrank.py WORLD DEAD_RANK SLOW_STEP KILL_STEP LIVENESS_S`` starts the other
ranks itself (Lightning's subprocess script launcher, as a user runs a script: this process is
rank 0). At ``SLOW_STEP`` rank ``DEAD_RANK`` sleeps ``3 * LIVENESS_S`` in its training step (slow
but alive: it must not be named); at ``KILL_STEP`` it SIGKILLs itself (``-1``: never). Every rank
prints ``STEP-REACHED <rank> <step> <time>`` at those steps so the test can time the detection.

Rank 0 then prints its failed collective's traceback and stays in a failure handler for
``SLOW_HANDLER_S`` (a script that saves or uploads something when a fit fails), longer than the
watchdog's grace period: the watchdog ends it with exit code 1. The launcher's child-process
observer polls the children every 5 s and must leave rank 0 to the watchdog; an observer that
kills at its first poll after the death would always SIGKILL rank 0 before the watchdog's exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import RecordingLM, leave_together  # noqa: E402

from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402

WORLD, DEAD, SLOW_STEP, KILL_STEP = (int(a) for a in sys.argv[1:5])
LIVENESS_S = float(sys.argv[5])
SLOW_HANDLER_S = 60.0


def say(line: str) -> None:
    """One write per line: the ranks share the pipe, and print() writes the newline separately."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


class DyingLM(RecordingLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.global_step
        if step in (SLOW_STEP, KILL_STEP) and batch_idx == step:
            say(f"STEP-REACHED {self.global_rank} {step} {time.time():.3f}")
            if self.global_rank == DEAD and step == SLOW_STEP:
                time.sleep(3 * LIVENESS_S)
            if self.global_rank == DEAD and step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    strategy = FoldedMoEStrategy(ep=2, rank_liveness_timeout_s=LIVENESS_S, timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=max(SLOW_STEP, KILL_STEP) + 2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    try:
        trainer.fit(DyingLM())
    except Exception:
        traceback.print_exc()  # the collective's own failure, the watchdog's line as its note
        sys.stderr.flush()
        if trainer.global_rank == 0:
            time.sleep(SLOW_HANDLER_S)
        raise
    say(f"FIT-DONE {trainer.global_rank}")
    leave_together()


if __name__ == "__main__":
    main()
