"""StepTimer: the training step's wall time and the device's peak memory, printed when fit ends.

``Trainer(callbacks=[StepTimer()])`` or ``--trainer.callbacks+=lightning_moe.callbacks.StepTimer``.
Each optimizer step is timed from the start of its first micro-batch to the end of its last (on
CUDA the device is synchronized at both ends, so the time is the device's, not the launch queue's);
the first ``skip_steps`` steps (compilation, kernel builds, CUDA-graph capture, allocator growth)
are left out. At the end of fit rank zero prints one line::

    step time: 41.3 ms median (p90 44.0) over 95 steps; peak memory: 12.41 GiB allocated, 13.00 GiB reserved

and the figures are kept in ``summary`` (a dict) for programs that read them. The device is the
module's at the start of fit: by the end of fit Lightning's single-device and DDP strategies have
moved the module back to the CPU (their ``teardown`` runs before ``on_fit_end``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

__all__ = ["StepTimer"]


class StepTimer(L.Callback):
    """Median step time and peak device memory of a fit.

    Args:
        skip_steps: optimizer steps left out at the start (warm-up); ``>= 0``.
    """

    def __init__(self, skip_steps: int = 5) -> None:
        super().__init__()
        if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 0:
            raise ValueError(f"StepTimer: skip_steps={skip_steps!r} must be an int >= 0; use e.g. skip_steps=5.")
        self.skip_steps = skip_steps
        self.step_ms: list[float] = []
        self.summary: dict[str, float] = {}
        self._started: float | None = None
        self._step_at_start = -1
        self._device = torch.device("cpu")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step_ms, self.summary, self._started = [], {}, None
        self._device = pl_module.device  # where the strategy put the module; on_fit_end may find it on the CPU
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._started is None:
            _sync(self._device)
            self._started, self._step_at_start = time.perf_counter(), trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None or trainer.global_step == self._step_at_start:
            return  # a micro-batch of gradient accumulation: the step goes on
        _sync(self._device)
        if self._step_at_start >= self.skip_steps:
            self.step_ms.append(1000.0 * (time.perf_counter() - self._started))
        self._started = None

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.summary = {"steps_timed": float(len(self.step_ms))}
        if self.step_ms:
            ordered = sorted(self.step_ms)
            self.summary["median_ms"] = statistics.median(ordered)
            self.summary["p90_ms"] = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        if self._device.type == "cuda":
            self.summary["peak_allocated_gib"] = torch.cuda.max_memory_allocated(self._device) / 2**30
            self.summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self._device) / 2**30
        if trainer.global_rank == 0:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """The one line printed at the end of fit."""
        s = self.summary
        if "median_ms" in s:
            line = f"step time: {s['median_ms']:.1f} ms median (p90 {s['p90_ms']:.1f}) over {int(s['steps_timed'])} steps"
        else:
            line = f"step time: no step past the first {self.skip_steps} was timed"
        if "peak_allocated_gib" in s:
            line += (
                f"; peak memory: {s['peak_allocated_gib']:.2f} GiB allocated, "
                f"{s['peak_reserved_gib']:.2f} GiB reserved"
            )
        return line


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
