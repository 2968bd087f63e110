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
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "SELECTED_TESTS", "Launch", "Suite", "ValidationLoss", "free_port", "launch_torchrun", "lost_port_race",
    "run_cli_fit", "run_torchrun", "run_torchrun_module", "selected_tests", "validation_loss",
]

HERE = Path(__file__).resolve().parent
# The tests this pytest run will run, stored in ``config.stash`` by conftest.py at collection.
SELECTED_TESTS = pytest.StashKey[list[pytest.Item]]()


def selected_tests(config: pytest.Config) -> list[pytest.Item]:
    """The tests selected to run (after ``-k``, ``-m`` and ``--deselect``); empty before collection."""
    return config.stash.get(SELECTED_TESTS, [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """What one torchrun job left: its exit code (``None`` if it was killed at the timeout)."""

    script: str
    world_size: int
    returncode: int | None
    output: str
    timeout: float

    def failure(self, tail: int = 8000) -> str:
        """A one-paragraph reason plus the output's tail; empty if the job succeeded."""
        if self.returncode == 0:
            return ""
        how = f"timed out after {self.timeout}s" if self.returncode is None else f"failed (rc={self.returncode})"
        return f"{self.script} on {self.world_size} ranks {how}:\n{self.output[-tail:]}"


_PORT_TAKEN = ("EADDRINUSE", "Address already in use")
# A gloo rank aborting in C++ teardown (a joinable std::thread destroyed) after its work is done;
# seen once in CI on the 2-core machine, with rank 0's full report already printed.
_TEARDOWN_ABORT = ("terminate called without an active exception",)


def lost_port_race(returncode: int | None, output: str) -> bool:
    """True when a job failed only because the port ``free_port`` gave was taken before it bound it."""
    return returncode not in (0, None) and any(marker in output for marker in _PORT_TAKEN)


def launch_torchrun(
    script: str, world_size: int, args: list[str], timeout: float, cwd: Path | None = None, module: bool = False
) -> Launch:
    """Run ``tests/dist/<script>`` on ``world_size`` CPU ranks; never raises for the job's outcome.

    ``free_port`` releases its port before torchrun binds it; a job that lost that race runs once
    more on a new port, and so does a job whose only trouble was a C++ abort in gloo's teardown
    (``_TEARDOWN_ABORT``). Any other failure, or a second one, is the test's. ``module=True`` runs
    the Python module ``script`` (``torchrun -m lightning_moe.export``) instead of a worker file.
    """
    job = _launch_once(script, world_size, args, timeout, cwd, module)
    retry_markers = _PORT_TAKEN + _TEARDOWN_ABORT
    if job.returncode not in (0, None) and any(marker in job.output for marker in retry_markers):
        job = _launch_once(script, world_size, args, timeout, cwd, module)
    return job


def _launch_once(
    script: str, world_size: int, args: list[str], timeout: float, cwd: Path | None, module: bool = False
) -> Launch:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *(["-m", script] if module else [str(HERE / script)]),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Launch(script, world_size, proc.returncode, out, timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Launch(script, world_size, None, out, timeout)


def run_torchrun(script: str, world_size: int, args: list[str], timeout: float, cwd: Path | None = None) -> str:
    """Run ``tests/dist/<script>`` on ``world_size`` CPU ranks; raise with the output on failure."""
    job = launch_torchrun(script, world_size, args, timeout, cwd)
    if job.returncode != 0:
        raise AssertionError(job.failure())
    return job.output


def run_torchrun_module(module: str, world_size: int, args: list[str], timeout: float, cwd: Path | None = None) -> str:
    """``torchrun -m <module>`` on ``world_size`` CPU ranks; raise with the output on failure."""
    job = launch_torchrun(module, world_size, args, timeout, cwd, module=True)
    if job.returncode != 0:
        raise AssertionError(job.failure())
    return job.output


@dataclass(frozen=True)
class Suite:
    """The parts' output folder and the job that filled it."""

    out: Path
    job: Launch

    def check(self, part: str) -> None:
        """Fail the calling test unless ``part`` finished (rank 0 printed ``PART OK <part>``)."""
        if f"PART OK {part} " in self.job.output:
            return
        reason = self.job.failure() or self.job.output[-8000:]
        pytest.fail(f"worker_suite part {part!r} did not finish:\n{reason}", pytrace=False)


def run_cli_fit(config: str, extra_args: list[str], cwd: Path, timeout: float) -> str:
    """``lightning-moe fit --config configs/<config>`` as a user runs it (Lightning launches the
    ranks); fails the test on a non-zero exit or a timeout (the whole process group is killed)."""
    import shutil

    root = Path(__file__).resolve().parents[2]
    script = shutil.which("lightning-moe")  # Lightning re-runs argv for the other ranks: no ``-c``
    entry = [script] if script else [sys.executable, "-m", "lightning_moe.cli"]
    cmd = [*entry, "fit", "--config", str(root / "configs" / config), *extra_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"lightning-moe fit timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


@dataclass(frozen=True)
class ValidationLoss:
    """The line ``lightning-moe fit`` prints at the end: the validation loss before training and last."""

    first: float
    first_step: int
    last: float
    last_step: int


def validation_loss(out: str) -> ValidationLoss:
    """Parse ``validation loss: A at step N -> B at step M`` from a fit's output; fail the test without it."""
    import re

    found = re.search(r"validation loss: (\S+) at step (\d+) -> (\S+) at step (\d+)", out)
    if found is None:
        pytest.fail(f"no validation loss line in the fit's output:\n{out[-3000:]}", pytrace=False)
    return ValidationLoss(float(found.group(1)), int(found.group(2)), float(found.group(3)), int(found.group(4)))
