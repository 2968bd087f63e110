"""A Trainer fit under Lightning's own launcher where one rank stalls, then SIGKILLs itself.

``python worker_deadrank.py WORLD DEAD_RANK SLOW_STEP KILL_STEP LIVENESS_S`` starts the other
ranks itself (Lightning's subprocess script launcher: this process is rank 0). At ``SLOW_STEP``
rank ``DEAD_RANK`` sleeps ``3 * LIVENESS_S`` in its training step (slow but alive: it must not be
named); at ``KILL_STEP`` it SIGKILLs itself (``-1``: never). Every rank prints
``STEP-REACHED <rank> <step> <time>`` at those steps so the test can time the detection.

Lightning's launcher starts the other ranks as it starts them for a user, but its child-process
observer is turned off (:func:`without_child_observer`). That thread polls the children every 5 s
and SIGKILLs this process once one of them has died: had it run, whether rank 0 named the dead
rank, or printed its collective's traceback, before being killed would depend on where the dead
rank's SIGKILL fell in the observer's 5 s period and on how busy the machine was. What this worker
shows is the product's own detection, so nothing else may end the survivors first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as pl
import lightning.pytorch.strategies.launchers.subprocess_script as subprocess_launcher
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import RecordingLM, leave_together  # noqa: E402

from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402

WORLD, DEAD, SLOW_STEP, KILL_STEP = (int(a) for a in sys.argv[1:5])
LIVENESS_S = float(sys.argv[5])


def without_child_observer() -> None:
    """Turn off the thread Lightning's subprocess script launcher starts to watch its children."""
    if not callable(getattr(subprocess_launcher, "_launch_process_observer", None)):
        raise RuntimeError(
            "lightning.pytorch.strategies.launchers.subprocess_script has no _launch_process_observer: "
            "find where this Lightning version starts its child-process observer and turn it off here."
        )

    def no_observer(child_processes: list[Any]) -> None:
        return None

    subprocess_launcher._launch_process_observer = no_observer


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
    without_child_observer()
    strategy = FoldedMoEStrategy(ep=2, rank_liveness_timeout_s=LIVENESS_S, timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=max(SLOW_STEP, KILL_STEP) + 2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(DyingLM())
    say(f"FIT-DONE {trainer.global_rank}")
    leave_together()


if __name__ == "__main__":
    main()
