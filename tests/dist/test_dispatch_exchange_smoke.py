"""``benchmarks/dispatch_exchange.py`` on 2 gloo ranks.

On GPUs the script compares DeepEP / Hybrid-EP / all-to-all against the closed form (itself
checked in ``tests/unit/test_benchmarks_smoke.py``); here the script runs end to end with
``--check`` (all-to-all exact in fp32; the libraries, absent here, reported as skipped rather
than failed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _harness import launch_torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dispatch_exchange.py"


def test_dispatch_exchange_quick_check_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "exchange.json"
    job = launch_torchrun(str(SCRIPT), 2, ["--quick", "--check", "--iters", "3", "--warmup", "1",
                                           "--dispatchers", "alltoall,alltoall_dedup,deepep", "--out", str(out)], timeout=90.0)  # fmt: skip
    assert job.returncode == 0, job.failure()
    report = json.loads(out.read_text())
    a2a = report["rows"]["alltoall"]
    assert max(a2a["y_err"], a2a["dx_err"], a2a["dw_err"]) < 1e-5 and a2a["rows_ok"]
    dedup = report["rows"]["alltoall_dedup"]
    assert max(dedup["y_err"], dedup["dx_err"], dedup["dw_err"]) < 1e-5 and dedup["rows_ok"]
    assert a2a["dispatch_ms"] > 0 and a2a["combine_ms"] > 0 and a2a["round_trip_fwd_bwd_ms"] > 0
    assert report["payload_mb_per_rank"] > 0 and report["nccl_a2a_gb_s"] > 0
    assert "deep_ep" in report["rows"]["deepep"]["skipped"]
