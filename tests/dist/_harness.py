"""Launch a worker script on W gloo ranks with torchrun, with a hard timeout.

A hang (a collective that never completes) becomes a test failure: the whole process group is
killed after ``timeout`` seconds and the tail of its output is shown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["run_torchrun", "free_port"]

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, world_size: int, args: list[str], timeout: float, cwd: Path | None = None) -> str:
    """Run ``tests/dist/<script>`` on ``world_size`` CPU ranks; raise with the output on failure."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} on {world_size} ranks timed out after {timeout}s:\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} on {world_size} ranks failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out
