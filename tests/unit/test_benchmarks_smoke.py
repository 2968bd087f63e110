"""Smoke tests of the benchmark scripts: they run end to end on CPU with tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_moe.moe.dispatch import LocalDispatcher

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROBES = BENCHMARKS / "probes"


def _load(name: str) -> ModuleType:
    """A benchmark module by name: ``benchmarks/NAME.py``, else ``benchmarks/probes/NAME.py``.

    With ``benchmarks/`` on the module path, as for ``python3 benchmarks/NAME.py`` (the script's own
    folder) and ``PYTHONPATH=benchmarks python3 benchmarks/probes/NAME.py``: the scripts import their
    siblings by name and edit no path themselves."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    path = BENCHMARKS / f"{name}.py"
    if not path.exists():
        path = PROBES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_e2e_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch.distributed as dist

    had_process_group = dist.is_initialized()
    e2e = _load("e2e")
    out = tmp_path / "e2e.json"
    report = e2e.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["results"].keys() == set(e2e.CONTENDERS)
    results = report["results"]
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and len(r["step_ms"]) == report["shape"]["steps"]
    # the swapped HF model is the HF model: same parameter count, same FLOPs
    assert results["lightning_moe_hf"]["active_params"] == results["hf"]["active_params"]
    assert results["lightning_moe_hf"]["flops_per_token"] == results["hf"]["flops_per_token"]
    assert "lightning_moe_hf/hf tokens_per_s" in report["ratios"]
    assert dist.is_initialized() == had_process_group  # the script leaves no process group behind


def test_moe_layer_benchmark_quick_runs_and_writes_json(tmp_path: Path) -> None:
    """benchmarks/moe_layer.py on tiny CPU shapes: our layer, a peer and the breakdown all run."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer.py"
    out = tmp_path / "layer.json"
    args = [sys.executable, str(script), "--quick", "--peers", "torch-grouped_mm-ref", "--skew", "0,2", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    peers = {(r["shape"], r["peer"]) for r in results}
    assert {("tiny", "lightning-moe"), ("tiny", "torch-grouped_mm-ref"), ("tiny/skew2", "lightning-moe")} <= peers
    assert all("error" not in r for r in results if r["peer"] in ("lightning-moe", "torch-grouped_mm-ref"))
    breakdown = [r for r in results if r["peer"] == "breakdown"]
    assert breakdown and {"wgrad_ms", "fwd_ms", "bwd_ms"} <= set(breakdown[0]["gemms_fwd_bwd_alone"])


def test_step_timeline_finds_idle_time_and_the_host_ops_before_the_first_long_kernel() -> None:
    profiling = _load("profiling")

    def x(name: str, cat: str, ts: float, dur: float, corr: int | None = None) -> dict:
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        x("step", "user_annotation", 1000, 900),
        x("aten::mm", "cpu_op", 1010, 30), x("aten::addmm", "cpu_op", 1012, 10),  # nested: not top level
        x("aten::softmax", "cpu_op", 1050, 20),
        x("cudaLaunchKernel", "cuda_runtime", 1020, 5, 1), x("cudaLaunchKernel", "cuda_runtime", 1200, 5, 2),
        x("small", "kernel", 1030, 10, 1),  # 30 us after the step began, then idle until the long one
        x("gemm", "kernel", 1300, 400, 2), x("memset", "gpu_memset", 1650, 100),  # overlaps the gemm
        x("tail", "kernel", 1800, 50),
    ]}
    t = profiling.step_timeline(trace)
    assert t["span_ms"] == pytest.approx(0.85)  # step start 1000 -> last end 1850
    assert t["busy_ms"] == pytest.approx((10 + 450 + 50) / 1e3)
    assert t["idle_ms"] == pytest.approx((850 - 510) / 1e3)
    assert t["first_long_start_ms"] == pytest.approx(0.3) and t["first_long_kernel"] == "gemm"
    assert t["first_long_launch_ms"] == pytest.approx(0.2)
    assert t["host_ops_before_first_long"] == [["aten::mm", 0.03], ["aten::softmax", 0.02]]
    assert t["gaps"][0] == [0.26, "small", "gemm"]  # 1040 -> 1300
    with pytest.raises(ValueError, match="record_function"):
        profiling.step_timeline({"traceEvents": []})


def test_closed_form_matches_a_token_loop_and_the_local_dispatcher() -> None:
    """The closed form of the GPU parity check against a per-token loop and ``LocalDispatcher``;
    a wrong expert scale must push the error far past the tolerance."""
    bench = _load("dispatch_exchange")
    E = 8
    x, ids, w, grad = bench.routed_tokens(40, 16, E, 3, seed=1, device=torch.device("cpu"), dtype=torch.float32)
    scales = bench.expert_scales(E, x.device)
    y, dx, dw = bench.closed_form(x, ids, w, grad, scales)
    for t in range(x.shape[0]):  # the definition, token by token
        factor = sum(float(w[t, k]) * float(scales[ids[t, k]]) for k in range(3))
        torch.testing.assert_close(y[t], factor * x[t].float())
        torch.testing.assert_close(dw[t], scales[ids[t]].float() * float((x[t] * grad[t]).sum()))
    x_ = x.clone().requires_grad_(True)
    w_ = w.clone().requires_grad_(True)
    got, _ = bench._round_trip(LocalDispatcher(E), x_, ids, w_, scales)
    got.backward(grad)
    torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_.grad, dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_.grad, dw, rtol=1e-5, atol=1e-6)
    wrong, _ = bench._round_trip(LocalDispatcher(E), x, ids, w, scales.flip(0))  # experts mixed up
    assert (wrong - y).abs().max() / y.abs().max() > 0.05


def test_wgrad_in_layer_arms_ask_the_forward_for_the_right_kernel() -> None:
    """The arms' spec language: what the forward is asked for, and the backward-only w2 override."""
    bench = _load("wgrad_in_layer")
    arms = {spec: bench._Arm(spec) for spec in ("streams", "cutlass@cooperative", "w2=cutlass@cooperative-c1x2")}
    assert [a.forward_kernel() for a in arms.values()] == ["streams", "cutlass@cooperative", "streams"]
    assert [a.w2_cutlass_tile for a in arms.values()] == [None, None, "cooperative-c1x2"]
    for bad in ("w2=cutlass@nope", "fastest"):
        with pytest.raises(SystemExit, match="--arms"):
            bench._Arm(bad)


def test_clock_samples_and_arm_settings_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvidia-smi sampler's line parser and reason names; layer_arms' arm specs; the env helper restores."""
    clocks = _load("gpu_clocks")
    stamp, mhz, watts, mask = clocks._parse("2026/11/29 23:10:01.250, 1710, 689.41, 0x0000000000000004")
    assert (mhz, watts, mask) == (1710.0, 689.41, 4) and stamp % 1 == pytest.approx(0.25)
    assert clocks._parse("2026/11/29 23:10:01.250, 1710, [N/A], 0x4") is None
    assert clocks.reasons(0x4) == "sw-power-cap" and clocks.reasons(0x5) == "idle+sw-power-cap"
    assert clocks.reasons(0) == "none"
    arms = _load("layer_arms")
    assert arms.parse_arm("gemm:LIGHTNING_MOE_GEMM_KERNEL=cutlass+X=1") == (
        "gemm", {"LIGHTNING_MOE_GEMM_KERNEL": "cutlass", "X": "1"})
    assert arms.parse_arm("default:") == ("default", {})
    with pytest.raises(ValueError, match="'oops' is not NAME=VALUE"):
        arms.parse_arm("bad:oops")
    layer = _load("moe_layer")
    monkeypatch.setenv("LMOE_TEST_KEPT", "before")
    monkeypatch.delenv("LMOE_TEST_NEW", raising=False)
    with layer.environment({"LMOE_TEST_KEPT": "during", "LMOE_TEST_NEW": "x", "LMOE_TEST_NONE": None}):
        assert os.environ["LMOE_TEST_KEPT"] == "during" and os.environ["LMOE_TEST_NEW"] == "x"
        assert "LMOE_TEST_NONE" not in os.environ
    assert os.environ["LMOE_TEST_KEPT"] == "before" and "LMOE_TEST_NEW" not in os.environ


def test_what_if_arms_run_each_skipped_op_once_and_restore_it() -> None:
    """layer_arms' ``no-bandwidth`` arm: the bandwidth-bound ops run once, then hand out that result."""
    arms = _load("layer_arms")
    layer_mod = _load("moe_layer")
    import lightning_moe.ops.local_experts as local_ops

    names = ("_expert_rows_impl", "_unpermute_sum_impl", "weighted_swiglu_forward", "weighted_swiglu_backward")
    originals = {name: getattr(local_ops, name) for name in names}
    calls = dict.fromkeys(names, 0)

    def counting(name: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    layer = layer_mod.ours(64, 32, 8, 2, "cpu", 0.0).float()
    x = torch.randn(128, 64, requires_grad=True)
    try:
        for name in names:
            setattr(local_ops, name, counting(name))
        with arms.skipped("no-bandwidth"):
            for _ in range(3):
                x.grad = None
                layer(x).backward(torch.randn(128, 64))
        skipped_calls = dict(calls)
        layer(x).backward(torch.randn(128, 64))  # restored: they run again
    finally:
        for name, fn in originals.items():
            setattr(local_ops, name, fn)
    assert all(n == 1 for n in skipped_calls.values()), skipped_calls
    assert all(calls[name] > skipped_calls[name] for name in names), calls


def test_floor_arm_runs_the_kept_traffic_and_keeps_the_gather_sums() -> None:
    """layer_arms' ``floor`` arm: SwiGLU runs once, then only the traffic its fusion would keep; the
    gather-sums still run every step; the one-call router stays."""
    arms = _load("layer_arms")
    layer_mod = _load("moe_layer")
    import lightning_moe.ops.local_experts as local_ops
    from lightning_moe.moe.router import TopKRouter

    traffic_calls = {name: 0 for name in arms._KEPT_TRAFFIC}
    originals = dict(arms._KEPT_TRAFFIC)
    sums = {"n": 0}
    real_sum = local_ops._unpermute_sum_impl

    def counting_sum(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sums["n"] += 1
        return real_sum(*args, **kwargs)

    def counting(name: str):  # noqa: ANN202
        def call(*args) -> None:  # noqa: ANN002
            traffic_calls[name] += 1
            originals[name](*args)

        return call

    layer = layer_mod.ours(64, 32, 8, 2, "cpu", 0.0).float()
    x = torch.randn(128, 64, requires_grad=True)
    one_call = TopKRouter.route_and_permute
    try:
        local_ops._unpermute_sum_impl = counting_sum
        for name in originals:
            arms._KEPT_TRAFFIC[name] = counting(name)
        with arms.skipped("floor"):
            assert TopKRouter.route_and_permute is one_call
            for _ in range(3):
                x.grad = None
                layer(x).backward(torch.randn(128, 64))
    finally:
        local_ops._unpermute_sum_impl = real_sum
        arms._KEPT_TRAFFIC.update(originals)
    assert TopKRouter.route_and_permute is one_call
    assert traffic_calls == {"weighted_swiglu_forward": 2, "weighted_swiglu_backward": 2}, traffic_calls
    assert sums["n"] == 6  # forward and backward gather-sums of all three steps


def test_router_ops_arm_turns_the_one_call_router_off_until_restored() -> None:
    arms = _load("layer_arms")
    from lightning_moe.moe.router import TopKRouter

    one_call = TopKRouter.route_and_permute
    with arms.skipped("router-ops"):
        assert TopKRouter.route_and_permute is not one_call  # on CPU the real one answers None too
        assert TopKRouter.route_and_permute(object(), torch.zeros(2, 4)) is None
    assert TopKRouter.route_and_permute is one_call


def test_fp8_layer_benchmark_quick_runs_and_compares_to_bf16(tmp_path: Path) -> None:
    """benchmarks/fp8_layer.py on a tiny CPU shape with emulated FP8: the arms run and are compared to bf16."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_layer.py"
    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--recipes", "blockwise,rowwise", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["peer"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"bf16", "fp8[blockwise]", "fp8[rowwise]", "fp8[auto]"}
    assert all("error" not in r for r in results.values()), results
    for recipe in ("blockwise", "rowwise"):  # quantized: close to bf16, never equal to it
        r = results[f"fp8[{recipe}]"]
        assert 0 < r["output_rel_err_vs_bf16"] < 0.1 and 0 < r["output_cos_dist_vs_bf16"] < 0.01, r
    assert results["fp8[auto]"]["output_rel_err_vs_bf16"] == 0.0  # auto keeps the tiny shape in bf16


def test_packed_vs_padded_quick_trains_both_arms_on_the_same_real_tokens(tmp_path: Path) -> None:
    import torch.distributed as dist

    had_process_group = dist.is_initialized()
    bench = _load("packed_vs_padded")
    out = tmp_path / "packed.json"
    report = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["results"].keys() == {"padded", "packed"}
    padded, packed = report["results"]["padded"], report["results"]["packed"]
    assert padded["real_tokens"] == packed["real_tokens"] > 0
    assert padded["rows"] > packed["rows"] and packed["row_fill"] > padded["row_fill"]
    assert padded["timed_steps"] == len(padded["step_ms"]) and packed["timed_steps"] == len(packed["step_ms"])
    assert padded["real_tokens_per_s"] > 0 and packed["real_tokens_per_s"] > 0
    assert padded["attention_backend"] == packed["attention_backend"] == "sdpa"  # CPU
    assert report["packed_over_padded_real_tokens_per_s"] > 0
    assert dist.is_initialized() == had_process_group


def test_packed_vs_padded_rows_hold_every_document_once() -> None:
    bench = _load("packed_vs_padded")
    docs = bench.corpus(2000, 16, 256, 100, seed=3)
    assert [d.tolist() for d in docs] == [d.tolist() for d in bench.corpus(2000, 16, 256, 100, seed=3)]
    assert all(16 <= d.numel() <= 256 for d in docs) and sum(d.numel() for d in docs) >= 2000
    padded = bench.whole_batches(bench.padded_rows(docs, 256), 4)
    packed = bench.whole_batches(bench.packed_rows(docs, 256), 4)
    assert padded.num % 4 == 0 and packed.num % 4 == 0 and padded.num >= len(docs)
    # one label per document token (the last one predicts EOS) in both layouts
    want = sum(d.numel() for d in docs)
    assert int(padded.real_tokens().sum()) == int(packed.real_tokens().sum()) == want
    assert set(padded.rows) == {"input_ids", "labels"} and "document_ids" in packed.rows
    with pytest.raises(ValueError, match="min_len <= max_len"):
        bench.corpus(10, 300, 256, 100, seed=0)


def test_long_context_search_doubles_then_bisects_and_stops_where_told() -> None:
    lc = _load("long_context")

    def limited(limit: int, seen: list[int], error_at: int | None = None):  # noqa: ANN202
        def trial(n: int):  # noqa: ANN202
            seen.append(n)
            if error_at is not None and n >= error_at:
                return lc.Trial(n, ok=False, error="RuntimeError: not a memory problem")
            return lc.Trial(n, ok=n <= limit, oom=n > limit, tokens_per_s=1.0 if n <= limit else None)

        return trial

    seen: list[int] = []
    r = lc.search(limited(40000, seen), 4096, 4096, 131072)
    assert (r.largest_ok, r.smallest_failed) == (36864, 40960)
    assert seen == [4096, 8192, 16384, 32768, 65536, 49152, 40960, 36864]
    assert r.best() is not None and r.best().seq_len == 36864
    seen = []
    r = lc.search(limited(10**9, seen), 4096, 4096, 100000)  # the cap: the last length is 98304
    assert seen == [4096, 8192, 16384, 32768, 65536, 98304] and r.largest_ok == 98304 and r.smallest_failed is None
    seen = []
    r = lc.search(limited(0, seen), 4096, 4096, 131072)  # even the first length fails
    assert seen == [4096] and r.largest_ok is None and r.best() is None
    seen = []
    r = lc.search(limited(10**9, seen, error_at=30000), 4096, 4096, 131072)  # not out of memory: no bisection
    assert seen == [4096, 8192, 16384, 32768] and r.largest_ok == 16384
    seen = []
    r = lc.search(limited(10**9, seen), 4096, 4096, 131072, out_of_time=lambda: len(seen) >= 2)
    assert seen == [4096, 8192] and r.stopped_by_time_budget and r.largest_ok == 8192
    with pytest.raises(ValueError, match="multiple of granularity"):
        lc.search(limited(1, []), 1000, 4096, 131072)


def test_long_context_quick_runs_trials_in_subprocesses(tmp_path: Path) -> None:
    lc = _load("long_context")
    out = tmp_path / "long.json"
    report = lc.main(["--quick", "--contenders", "lightning_moe", "--out", str(out)])
    assert json.loads(out.read_text())["fake_limit_tokens"] == 40
    r = report["results"]["lightning_moe"]
    assert (r["largest_seq_len"], r["smallest_failed_seq_len"]) == (32, 64), r["trials"]
    assert r["tokens_per_s_at_largest"] > 0 and [t["ok"] for t in r["trials"]] == [True, False]
    assert r["trials"][1]["oom"] and r["trials"][1]["error"] is None


def test_e2e_loss_curve_quick_compares_bf16_and_fp8_on_the_same_batches(tmp_path: Path) -> None:
    import torch.distributed as dist

    had_process_group = dist.is_initialized()
    curve = _load("e2e_loss_curve")
    out = tmp_path / "curve.json"
    report = curve.main(["--quick", "--out", str(out)])
    saved = json.loads(out.read_text())
    bf16, fp8 = saved["lightning_moe"]["losses"], saved["lightning_moe_fp8"]["losses"]
    assert len(bf16) == len(fp8) == report["shape"]["steps"]
    assert bf16[0] == pytest.approx(fp8[0], rel=1e-2)  # same weights and batch; FP8 experts only differ by rounding
    assert bf16 != fp8  # but the FP8 arm really ran FP8
    assert report["comparison"]["max_relative_gap_after_first_window"] < 0.05
    assert dist.is_initialized() == had_process_group


def test_loss_curve_windows_and_gaps() -> None:
    curve = _load("e2e_loss_curve")
    cmp = curve.compare([4.0] * 4 + [2.0] * 4, [4.0] * 4 + [2.02] * 4, size=4)
    assert cmp["bf16_windows"] == [4.0, 2.0] and cmp["relative_gaps"][0] == 0.0
    assert cmp["max_relative_gap_after_first_window"] == pytest.approx(0.01)
