"""The GPU's SM clock and power draw while a benchmark runs (NVML through torch.cuda; optional).

Two implementations can differ on the GPU only because one keeps the chip at its power cap, so
that its clocks drop over back-to-back steps: ``ClockSampler`` records both, every few
milliseconds, on a background thread, so each timed row can say what the chip ran at.

    with ClockSampler() as clocks:
        ...timed loop...
    clocks.summary()  # {"sm_mhz": ..., "power_w": ...} or {} without NVML
"""

from __future__ import annotations

import statistics
import threading

import torch

__all__ = ["ClockSampler"]


class ClockSampler:
    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.mhz: list[float] = []
        self.watts: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        if not torch.cuda.is_available():
            return False
        try:
            torch.cuda.clock_rate()
            torch.cuda.power_draw()
        except Exception:  # noqa: BLE001 - no NVML bindings (nvidia-ml-py) or no permission
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.mhz.append(float(torch.cuda.clock_rate()))
            self.watts.append(torch.cuda.power_draw() / 1000.0)  # milliwatts

    def __enter__(self) -> ClockSampler:
        if self.available():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.mhz:
            return {}
        return {"sm_mhz": round(statistics.median(self.mhz)), "power_w": round(statistics.median(self.watts))}
