"""Auto-resume: torchrun ``--max-restarts=1`` reruns the same command after a rank is SIGKILLed.

``worker_autoresume.py`` on 4 gloo ranks (TP2·DP2, EP4): rank 1 kills itself after step 6; the
restarted group resumes from the newest complete checkpoint (``fit(ckpt_path="last")``, which
started fresh on the first attempt) and ends with bitwise the parameters, expert biases and
losses of the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _harness import HERE, free_port

pytestmark = pytest.mark.dist


def _torchrun(out: Path, which: str, restarts: int) -> None:
    # c10d rendezvous with the workers' own store: each restart round gets fresh store keys. With the
    # agent's shared store (the default, and the static --master_port rendezvous) the restarted gloo
    # group reads the first attempt's addresses and its connect is refused (torch 2.13, CPU).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--max-restarts={restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(HERE / "worker_autoresume.py"),
           str(out), which]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"worker_autoresume {which} timed out:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-8000:]


def test_a_rank_killed_mid_run_restarts_and_ends_like_the_uninterrupted_run(tmp_path: Path) -> None:
    _torchrun(tmp_path, "full", 0)
    _torchrun(tmp_path, "killed", 1)
    full, killed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "killed.pt")
    assert killed["restarts"] == 1, "the group was not restarted"
    assert min(killed["losses"]) > 4, f"the restarted run started from scratch: steps {sorted(killed['losses'])}"
    for step, loss in killed["losses"].items():
        assert loss == full["losses"][step], (step, loss, full["losses"][step])
    for name, want in full["state"].items():
        assert torch.equal(killed["state"][name], want), name
