"""The GPU's SM clock, power draw and clock-event reasons while a benchmark runs (``nvidia-smi``).

On one H200 the expert GEMMs of a layer step hold the chip at its power cap (~700 W): the clock
drops (1575–1725 MHz instead of 1980) and the reason reads ``sw-power-cap``
(``benchmarks/probes/clock_probe.py``). A step then costs what its energy costs, not what its kernels
would take at full clock: two implementations can differ only because one draws more power.
``ClockSampler`` records clock, power and reasons every ``interval_ms`` in an ``nvidia-smi``
subprocess, so each timed row says what the chip ran at and why.

Read it over seconds, not over ``moe_layer.py``'s ~0.1 s of timed steps: over such a short window
right after the set-up, both this sampler and the earlier one (NVML through
``torch.cuda.clock_rate()`` / ``power_draw()`` on a Python thread) report ~1980 MHz and
~150–300 W for Qwen3-30B-A3B steps that run at ~1700 MHz and ~690 W over 2 s (``clock_probe.py``):
the power reading is an average over about a second, so a short window lags the chip.

    with ClockSampler() as clocks:
        ...timed loop...
    clocks.summary()  # {"sm_mhz": ..., "power_w": ..., "clock_reason": ...} or {} without nvidia-smi
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from collections import Counter

__all__ = ["ClockSampler", "energy_mj", "reasons"]

REASON_BITS = {
    0x1: "idle",
    0x2: "app-clocks",
    0x4: "sw-power-cap",
    0x8: "hw-slowdown",
    0x10: "sync-boost",
    0x20: "sw-thermal",
    0x40: "hw-thermal",
    0x80: "hw-power-brake",
    0x100: "display-clocks",
}


def reasons(mask: int) -> str:
    """The clock-event reasons of an ``nvidia-smi`` bit mask, joined with ``+`` (``none`` if none)."""
    return "+".join(name for bit, name in REASON_BITS.items() if mask & bit) or "none"


def energy_mj() -> float | None:
    """The GPU's energy counter (millijoules since the driver loaded), or ``None`` without it.

    Read before and after a run of steps: (after - before) / steps is the energy of one step, the
    quantity a power-capped chip spends its time on."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=total_energy_consumption", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    )
    try:
        return float(out.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


def _query_fields() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    for reason_field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):  # newer, older drivers
        fields = f"timestamp,clocks.sm,power.draw,{reason_field}"
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return fields
    return None


def _parse(line: str) -> tuple[float, float, float, int] | None:
    """``(unix time, SM MHz, watts, reason mask)`` of one CSV line, or ``None``."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        whole, _, frac = parts[0].partition(".")
        stamp = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + (float("0." + frac) if frac else 0.0)
        return stamp, float(parts[1]), float(parts[2]), int(parts[3], 16)
    except ValueError:
        return None


class ClockSampler:
    """``nvidia-smi`` sampling in a subprocess between ``__enter__`` and ``__exit__`` (nothing without it)."""

    def __init__(self, interval_ms: int = 20) -> None:
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, float, int]] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> ClockSampler:
        fields = _query_fields()
        if fields:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.samples = [s for s in map(_parse, out.splitlines()) if s is not None]

    def window(self, t0: float, t1: float) -> list[tuple[float, float, float, int]]:
        """The samples taken between two ``time.time()`` stamps."""
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def summary(self, t0: float = 0.0, t1: float = float("inf")) -> dict:
        inside = self.window(t0, t1)
        if not inside:
            return {}
        top_reason, _ = Counter(reasons(s[3]) for s in inside).most_common(1)[0]
        return {
            "sm_mhz": round(statistics.median(s[1] for s in inside)),
            "power_w": round(statistics.median(s[2] for s in inside)),
            "clock_reason": top_reason,
        }
