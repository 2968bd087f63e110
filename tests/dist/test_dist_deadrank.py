"""A rank SIGKILLed mid-fit under Lightning's own launcher is named by the survivors within 60 s.

One ``Trainer(devices=2, strategy=FoldedMoEStrategy(ep=2))`` run (``worker_deadrank.py``, started
as a user starts it: Lightning's subprocess script launcher makes rank 1): rank 1 first stalls
for 3x ``rank_liveness_timeout_s`` inside a training step (slow but alive: nobody may name it),
then SIGKILLs itself. The job's output must hold one line naming rank 1 and its layout
coordinates within 60 s of the kill, and every process must exit non-zero; the subprocess
timeout is the hang guard.

Rank 0 then stays in a slow failure handler (the worker's docstring says why), so the watchdog
ends it with exit code 1 after its grace period. Lightning's child-process observer, which the
launcher runs in rank 0, polls every 5 s: had it killed at its first poll after the death, rank 0
would always be SIGKILLed first. The launcher's observer must wait for the watchdog instead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from _harness import HERE, free_port, lost_port_race

LIVENESS_S, SLOW_STEP, KILL_STEP = 5.0, 2, 4
JOB_TIMEOUT_S = 480.0
_NAMED = re.compile(r"FoldedMoEStrategy: rank 1 \(dp=1 ep=1\) is gone: its process \d+ on \S+ no longer runs")

Lines = list[tuple[float, str]]  # (time read, line) of the job's stdout and stderr together


def run_job() -> tuple[int | None, Lines]:
    """One run of the worker: rank 0's exit code (``None``: killed at the timeout) and its output."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)
    args = [sys.executable, str(HERE / "worker_deadrank.py"), "2", "1", str(SLOW_STEP), str(KILL_STEP), str(LIVENESS_S)]
    proc = subprocess.Popen(
        args, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: Lines = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank of the job, not only rank 0
        proc.wait()
        rc = None
    reader.join(10)
    return rc, lines


def test_dead_rank_is_named_and_every_rank_exits_nonzero() -> None:
    rc, lines = run_job()
    if lost_port_race(rc, "\n".join(text for _, text in lines)):
        rc, lines = run_job()
    output = "\n".join(text for _, text in lines)
    tail = output[-6000:]
    assert rc is not None, f"the job hung (killed after {JOB_TIMEOUT_S:.0f} s):\n{tail}"
    assert rc != 0, f"rank 0 exited with 0 after rank 1 died:\n{tail}"
    assert rc != -signal.SIGKILL, f"rank 0 was SIGKILLed, not ended by its watchdog:\n{tail}"
    assert rc == 1, f"rank 0 exited with {rc}, not with its watchdog's exit code 1:\n{tail}"
    assert "FIT-DONE" not in output, tail
    killed = [float(m.group(1)) for _, t in lines if (m := re.search(rf"STEP-REACHED 1 {KILL_STEP} (\d+\.\d{{3}})", t))]
    assert killed, f"rank 1 never reached its kill step (the stall at step {SLOW_STEP} was fatal?):\n{tail}"
    named = [(at, t) for at, t in lines if _NAMED.search(t)]
    assert named, f"no line names the dead rank:\n{tail}"
    detection_s = named[0][0] - killed[0]
    print(f"dead rank named {detection_s:.1f} s after its SIGKILL")
    assert detection_s <= 60.0, f"rank 1 named only {detection_s:.1f} s after its death:\n{tail}"
    stalled = [t for _, t in lines if "no heartbeat" in t]
    assert not stalled, f"the slow rank was named while alive: {stalled}"
    assert "Traceback" in output  # the collective's own failure, with the dead rank as its note
