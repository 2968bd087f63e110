"""Smoke test of benchmarks/callbacks_bench.py: every CPU-runnable arm, tiny shapes, JSON out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "callbacks_bench.py"


def test_callbacks_bench_quick_runs_every_arm_with_equal_losses(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("_bench_callbacks", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "callbacks.json"
    results = bench.main(["--quick", "--steps", "2", "--warmup", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    memory = saved["memory"]
    assert set(memory) == {"baseline", "recompute", "offload", "optimizer"}
    for arm in ("recompute", "offload", "optimizer"):
        assert memory[arm]["losses"] == memory["baseline"]["losses"], arm  # bitwise: features move data only
    assert memory["offload"]["extra"]["offloaded_gib_per_step"] > 0
    assert memory["optimizer"]["extra"]["optimizer_state_gib_on_device"] == 0
    if saved["device"] == "cpu":
        assert saved["graphs"] == {"skipped": "needs CUDA"}
    assert [row[0] for row in results["table"]][:1] == ["recompute"]
