"""Per-kernel GPU time and the step's GPU timeline from a ``torch.profiler`` run (shared by the benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def device_kernels(prof: Any) -> list[dict[str, Any]]:
    """Every device event of ``prof`` by name (kernels, copies): total ms and calls, longest first."""
    rows = []
    for evt in prof.key_averages():
        total_us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if total_us > 0:
            rows.append({"name": evt.key, "total_ms": total_us / 1e3, "count": int(evt.count)})
    rows.sort(key=lambda row: -row["total_ms"])
    return rows


def step_timeline(trace: str | Path | dict, step: str = "step", long_us: float = 100.0, gaps: int = 6) -> dict[str, Any]:
    """Where the device waits during one step, from a Chrome trace (``prof.export_chrome_trace``).

    ``step`` names the ``record_function`` range around the step (the last one is read); its host
    start is time 0.
    Returns milliseconds: ``span`` (step start to the last device event's end), ``busy`` (union
    of device events), ``idle`` (span - busy), ``first_long_start`` (when the first device event
    longer than ``long_us`` began: the device was all but idle before it, waiting for the host),
    ``first_long_launch`` (when the host launched it), ``host_ops_before_first_long`` (top-level
    host ops begun before that launch), and the ``gaps`` longest idle gaps with their neighbours.
    """
    events = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    marks = [e for e in events if e.get("name") == step and e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"]
    if not marks:
        raise ValueError(f"step_timeline: no host range named {step!r} in the trace; wrap the step in record_function({step!r}).")
    t0 = max(float(m["ts"]) for m in marks)
    device = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?"), e.get("args", {}).get("correlation"))
        for e in events
        if e.get("cat") in _DEVICE_CATS and e.get("ph") == "X" and float(e["ts"]) >= t0
    )
    if not device:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0}
    busy, cur_start, cur_end, gap_list, prev_name = 0.0, device[0][0], device[0][1], [], device[0][2]
    gap_list.append((device[0][0] - t0, "step start", device[0][2]))
    for start, end, name, _ in device[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gap_list.append((start - cur_end, prev_name, name))
            cur_start = start
        cur_end = max(cur_end, end)
        prev_name = name
    busy += cur_end - cur_start
    span = cur_end - t0
    out: dict[str, Any] = {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3}
    long = next((d for d in device if d[1] - d[0] >= long_us), None)
    if long is not None:
        out["first_long_start_ms"] = (long[0] - t0) / 1e3
        out["first_long_kernel"] = long[2][:80]
        launch = next(
            (e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") == long[3]),
            None,
        )
        if launch is not None:
            t_launch = float(launch["ts"])
            out["first_long_launch_ms"] = (t_launch - t0) / 1e3
            out["host_ops_before_first_long"] = _top_level_ops(events, t0, t_launch)
    gap_list.sort(key=lambda g: -g[0])
    out["gaps"] = [[round(g / 1e3, 3), before[:60], after[:60]] for g, before, after in gap_list[:gaps]]
    return out


def _top_level_ops(events: list[dict], t0: float, t1: float) -> list[list]:
    """Host ops (``cpu_op``) begun in ``[t0, t1)`` and not nested in another: name, host ms."""
    ops = sorted(
        (float(e["ts"]), float(e.get("dur", 0)), e.get("name", "?"))
        for e in events
        if e.get("cat") == "cpu_op" and e.get("ph") == "X" and t0 <= float(e["ts"]) < t1
    )
    top, until = [], -1.0
    for ts, dur, name in ops:
        if ts >= until:
            top.append([name[:60], round(dur / 1e3, 3)])
            until = ts + dur
    return top
