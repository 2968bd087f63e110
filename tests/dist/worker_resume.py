"""Worker: a folded run crashed at a step and resumed from its last checkpoint, vs uninterrupted.

``worker_suite.py`` part ``resume:<layout>`` (e.g. ``resume:ep=2``): on every rank, the
uninterrupted run into ``OUT/resume-<layout>/full``, then the same run stopped by an exception
raised on every rank after step ``KILL`` and resumed from its DCP ``last.ckpt``. Rank 0 saves both
runs' final full parameters (and expert biases); each rank writes its own per-step losses.
The run itself is ``tests/unit/_resume_run.py`` (the one-process resume test's run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _resume_run import KILL, Crash, run  # noqa: E402


def main(out: Path, spec: str) -> None:
    layout = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    world = dist.get_world_size()
    root = out / f"resume-{spec}"
    full, crashed = root / "full", root / "crashed"
    if dist.get_rank() == 0:
        full.mkdir(parents=True), crashed.mkdir(parents=True)
    dist.barrier()
    states = {"full": run(full, "full", "folded", world, layout)}
    try:
        run(crashed, f"raise={KILL}", "folded", world, layout)
        raise RuntimeError(f"worker_resume: the run did not crash at step {KILL}")
    except Crash:
        pass
    dist.barrier()
    states["resume"] = run(crashed, "resume", "folded", world, layout)
    if dist.get_rank() == 0:
        torch.save(states, root / "states.pt")
