"""How long the device waits for the host before the first expert GEMM of a step (no profiler).

The protocol synchronises after every step, so each step starts with an idle device: the router,
the permutation and the gather are small kernels the device finishes faster than the host
launches them, and the step cannot go faster than the host's path to the first grouped GEMM.
This measures that path with CUDA events (one recorded at the step start, one just before the
first expert GEMM is launched), plus the host time per call of the router's GEMM variants.

    PYTHONPATH=benchmarks python3 benchmarks/probes/host_path.py --shapes qwen3-30b-a3b,deepseek-v3
    PYTHONPATH=benchmarks python3 benchmarks/probes/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --profile-host 20

``--stages`` stamps the host clock when each stage of the forward starts (router GEMM, top-k,
permutation, fusion set-up, gather, first expert GEMM, ...) and prints the median microseconds
from the step's start: the host's path itemised, without a profiler's overhead.
``--router-variants`` times the host's cost of one call of each way to get the router's logits,
right after a synchronised layer step (cold, as in the step) and in a warm loop, with each cuBLAS
back end torch offers: which call is worth its host time on the path to the first GEMM.
``--cold-sequence`` times each call of a short sequence issued right after a synchronised step
(host µs per call, no profiler): whether only the first launch after the sync is slow or every
call for a while, which decides whether fewer calls or fewer Python operations pay.
``--profile-host N`` runs N synchronised steps under cProfile and prints the functions with the
most host time of their own: where the host's path goes, function by function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import peers  # noqa: E402  (benchmarks/peers.py: shapes)
from moe_layer import ours  # noqa: E402

import lightning_moe.ops.local_experts as local_ops  # noqa: E402


def first_gemm_ms(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor, steps: int = 10) -> dict:
    """Median ms from the step's start to the first expert GEMM's launch, and of the whole step."""
    marks: list[torch.cuda.Event] = []
    original = local_ops.gmm

    def marked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not marks:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[0].record()
        return original(*args, **kwargs)

    local_ops.gmm = marked
    try:
        to_gemm, whole = [], []
        for i in range(steps + 2):
            marks.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            layer(x).backward(go)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                to_gemm.append(start.elapsed_time(marks[0]))
                whole.append(start.elapsed_time(end))
    finally:
        local_ops.gmm = original
    return {"to_first_gemm_ms": round(statistics.median(to_gemm), 3), "step_ms": round(statistics.median(whole), 3)}


def host_us(fn, calls: int = 200) -> float:  # noqa: ANN001
    """Host microseconds per call (launches only; synchronised once at the end)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / calls * 1e6, 1)


# (module, attribute) pairs whose calls --stages stamps; a class attribute stamps a method.
_STAGES = (
    ("lightning_moe.moe.router:TopKRouter", "route_and_permute"),
    ("lightning_moe.moe.router", "route"),
    ("lightning_moe.moe.router", "router_logits"),
    ("lightning_moe.moe.router:TopKRouter", "_select"),
    ("lightning_moe.moe.dispatch.local", "build_permutation"),
    ("lightning_moe.moe.experts:GroupedExperts", "forward_local"),
    ("lightning_moe.ops.local_experts", "WgradFusion"),
    ("lightning_moe.ops.local_experts", "_expert_rows_impl"),
    ("lightning_moe.ops.local_experts", "gmm"),
    ("lightning_moe.ops.local_experts", "weighted_swiglu_forward"),
    ("lightning_moe.ops.local_experts", "_unpermute_sum_impl"),
)


def stage_us(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor, steps: int = 20) -> dict:
    """Median host µs from the step's start to each stamped call's entry (first call of each), and
    to the forward's return."""
    import importlib

    stamps: dict[str, float] = {}
    patched = []
    for where, name in _STAGES:
        module_name, _, cls = where.partition(":")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, cls) if cls else owner
        original = getattr(owner, name)

        def stamped(*args, __original=original, __label=f"{cls or module_name.rsplit('.', 1)[-1]}.{name}", **kwargs):  # noqa: ANN002, ANN003, ANN202
            stamps.setdefault(__label, time.perf_counter())
            return __original(*args, **kwargs)

        setattr(owner, name, stamped)
        patched.append((owner, name, original))
    rows: dict[str, list[float]] = {}
    try:
        for i in range(steps + 3):
            stamps.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = layer(x)
            t_forward = time.perf_counter()
            out.backward(go)
            t_backward = time.perf_counter()
            torch.cuda.synchronize()
            if i >= 3:
                for label, t in {**stamps, "forward returned": t_forward, "backward returned": t_backward}.items():
                    rows.setdefault(label, []).append((t - t0) * 1e6)
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    order = sorted(rows, key=lambda label: statistics.median(rows[label]))
    return {label: round(statistics.median(rows[label]), 1) for label in order}


def cold_us(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor, fn, steps: int = 15) -> float:  # noqa: ANN001
    """Median host µs of one ``fn()`` issued right after a synchronised layer step (cold caches)."""
    times = []
    for i in range(steps + 2):
        layer(x).backward(go)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((t1 - t0) * 1e6)
    return round(statistics.median(times), 1)


def cold_sequence(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor, steps: int = 15) -> dict:
    """Host µs of each call in a few sequences issued right after a synchronised step (median per position)."""
    xd, w = x.detach(), layer.router.weight.detach()
    dev = xd.device
    small = [torch.zeros(1, device=dev) for _ in range(8)]
    fill = lambda i: small[i].fill_(1.0)  # noqa: E731
    mm = lambda i: torch.mm(xd, w.t(), out_dtype=torch.float32)  # noqa: E731
    foreach = lambda i: torch._foreach_add_(small, 1.0)  # noqa: E731  (one C++ call, one launch)
    sequences = {
        "fill x8": [fill] * 8,
        "router mm x4": [mm] * 4,
        "fill then router mm x3": [fill, mm, mm, mm],
        "foreach x4": [foreach] * 4,
        "router forward x3": [lambda i: layer.router(x)] * 3,
    }
    out: dict = {}
    for name, calls in sequences.items():
        per_call: list[list[float]] = [[] for _ in calls]
        for i in range(steps + 2):
            layer(x).backward(go)
            torch.cuda.synchronize()
            stamps = [time.perf_counter()]
            for j, call in enumerate(calls):
                call(j)
                stamps.append(time.perf_counter())
            torch.cuda.synchronize()
            if i >= 2:
                for j in range(len(calls)):
                    per_call[j].append((stamps[j + 1] - stamps[j]) * 1e6)
        out[name] = [round(statistics.median(v), 1) for v in per_call]
    return out


def router_variants(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor) -> dict:
    """Host µs of each way to get the logits, cold and warm, under each cuBLAS back end."""
    xd, w = x.detach(), layer.router.weight.detach()
    calls = {
        "mm_out_fp32": lambda: torch.mm(xd, w.t(), out_dtype=torch.float32),
        "linear_bf16": lambda: F.linear(xd, w),
        "mm_fp32_upcast": lambda: torch.mm(xd.float(), w.float().t()),
        "router_forward": lambda: layer.router(x),
        "fill_kernel": lambda: torch.ones(1, device=xd.device),  # no cuBLAS: a cold launch's own cost
    }
    out: dict = {}
    backend = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in ("default", "cublas", "cublaslt")[: 1 if os.environ.get("ROUTER_VARIANTS_DEFAULT_ONLY") else 3]:
            if lib != "default":
                torch.backends.cuda.preferred_blas_library(lib)
            for name, fn in calls.items():
                try:
                    out[f"{lib}/{name}"] = {"cold_us": cold_us(layer, x, go, fn), "warm_us": host_us(fn)}
                except RuntimeError as e:  # a back end without this call
                    out[f"{lib}/{name}"] = {"error": str(e)[:120]}
    finally:
        torch.backends.cuda.preferred_blas_library(backend)
    return out


def profile_host(layer: torch.nn.Module, x: torch.Tensor, go: torch.Tensor, steps: int, top: int = 35) -> str:
    """cProfile over ``steps`` synchronised steps: the top functions by their own host time."""
    for _ in range(3):
        layer(x).backward(go)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        layer(x).backward(go)
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--fuse-wgrad", action="store_true", help="MoEConfig(fuse_wgrad_accumulation=True)")
    ap.add_argument("--stages", action="store_true", help="also stamp the forward's stages (host µs from step start)")
    ap.add_argument("--router-variants", action="store_true", help="also time the router GEMM's calls (host µs)")
    ap.add_argument("--cold-sequence", action="store_true", help="also time each call of short sequences after a sync")
    ap.add_argument("--profile-host", type=int, default=0, metavar="N", help="also cProfile N steps (host time)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_path.py times a CUDA step; no GPU is visible.")
    for name in a.shapes.split(","):
        T, H, Fh, E, k = peers.SHAPES[name]
        layer = ours(H, Fh, E, k, "cuda", 0.0, fuse_wgrad=a.fuse_wgrad)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = layer.router.weight.detach()
        xd = x.detach()
        row = {"shape": name, **first_gemm_ms(layer, x, go)}
        row["router_mm_out_fp32_us"] = host_us(lambda: torch.mm(xd, w.t(), out_dtype=torch.float32))
        row["router_linear_bf16_us"] = host_us(lambda: F.linear(xd, w))
        row["router_forward_us"] = host_us(lambda: layer.router(x))
        row["layer_forward_us"] = host_us(lambda: layer(x), calls=20)
        print(json.dumps(row), flush=True)
        if a.stages:
            print(json.dumps({"shape": name, "host_us_from_step_start": stage_us(layer, x, go)}), flush=True)
        if a.router_variants:
            print(json.dumps({"shape": name, "router_logits_host_us": router_variants(layer, x, go)}), flush=True)
        if a.cold_sequence:
            print(json.dumps({"shape": name, "cold_sequence_host_us": cold_sequence(layer, x, go)}), flush=True)
        if a.profile_host:
            print(f"== host profile, {name}, {a.profile_host} steps", flush=True)
            print(profile_host(layer, x, go, a.profile_host), flush=True)
        del layer, x, go
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
