"""``benchmarks/ep_scaling.py --quick`` on 2 gloo ranks: it finishes and writes a full report.

A smoke test of the multi-GPU benchmark's code path on CPU (tiny shapes, EP over both ranks);
the figures themselves are meaningless here, only their presence and sanity are checked. With
``--skew 4 --echo-spare 2`` the one check on a figure is that ECHO's clones flatten the EP-rank load
(rows processed per rank, clones included) below the plain router-count load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _harness import launch_torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ep_scaling.py"
FIELDS = (
    "world_size",
    "ep",
    "step_ms",
    "step_ms_max_rank",
    "tflops_per_gpu",
    "a2a_ms",
    "a2a_share",
    "a2a_calls_per_step",
    "load_max_over_mean",
    "load_max_over_mean_per_layer",
)


def test_ep_scaling_quick_writes_report_with_every_field_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ep_scaling.json"
    # launch_torchrun joins its script to tests/dist; an absolute path replaces that base
    job = launch_torchrun(str(SCRIPT), 2, ["--quick", "--out", str(out)], timeout=90.0)
    assert job.returncode == 0, job.failure()
    report = json.loads(out.read_text())
    assert report["skew"] == 0.0 and report["echo_spare"] == 0 and "echo_step_ms" not in report
    missing = [f for f in FIELDS if f not in report]
    assert not missing, f"fields {missing} missing from {sorted(report)}"
    assert report["world_size"] == 2 and report["ep"] == 2
    assert report["iters"] >= 8 and len(report["step_ms_all"]) == report["iters"]
    assert report["step_ms"] > 0 and report["tflops_per_gpu"] > 0
    # the wrapper saw the exchanges: 4 forward + 3 backward per layer (2 backward on the first
    # layer, whose input needs no gradient)
    layers = report["shape"]["layers"]
    assert report["a2a_calls_per_step"] == 7 * layers - 1
    assert report["a2a_ms"] > 0 and 0 < report["a2a_share"] < 1
    assert len(report["load_max_over_mean_per_layer"]) == layers
    assert all(v >= 1.0 for v in report["load_max_over_mean_per_layer"])


def test_ep_scaling_quick_skew_with_echo_flattens_rank_load_on_two_ranks(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ep_scaling_echo.json"
    # with a shared expert on the side stream (inert on CPU: the flag must pass through and compose)
    args = ["--quick", "--skew", "4", "--echo-spare", "2", "--shared-expert-ffn", "16", "--overlap-shared", "--out", str(out)]
    job = launch_torchrun(str(SCRIPT), 2, args, timeout=90.0)
    assert job.returncode == 0, job.failure()
    report = json.loads(out.read_text())
    assert report["skew"] == 4.0 and report["echo_spare"] == 2
    assert report["shared_expert_ffn"] == 16 and report["overlap_shared"] is True
    layers = report["shape"]["layers"]
    assert report["echo_step_ms"] > 0 and len(report["echo_step_ms_all"]) == report["iters"]
    assert len(report["echo_clones_per_layer"]) == layers and all(c >= 1 for c in report["echo_clones_per_layer"])
    plain, echo = (
        report["rank_load_max_over_mean_plain"],
        report["rank_load_max_over_mean_echo"],
    )
    assert len(report["rank_load_max_over_mean_echo_per_layer"]) == layers
    # the skew makes one EP rank busy; the clones move rows to the other one
    assert plain > 1.1, report["rank_load_max_over_mean_plain_per_layer"]
    assert 1.0 <= echo < plain, (plain, echo)
