"""Per-kernel device time from a finished ``torch.profiler`` run (shared by the benchmarks)."""

from __future__ import annotations

from typing import Any


def device_kernels(prof: Any) -> list[dict[str, Any]]:
    """Every device event of ``prof`` by name (kernels, copies): total ms and calls, longest first."""
    rows = []
    for evt in prof.key_averages():
        total_us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if total_us > 0:
            rows.append({"name": evt.key, "total_ms": total_us / 1e3, "count": int(evt.count)})
    rows.sort(key=lambda row: -row["total_ms"])
    return rows
