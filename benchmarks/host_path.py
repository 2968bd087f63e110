"""How long the device waits for the host before the first expert GEMM of a step (no profiler).

The protocol synchronises after every step, so each step starts with an idle device: the router,
the permutation and the gather are small kernels the device finishes faster than the host
launches them, and the step cannot go faster than the host's path to the first grouped GEMM.
This measures that path with CUDA events (one recorded at the step start, one just before the
first expert GEMM is launched), plus the host time per call of the router's GEMM variants.

    python benchmarks/host_path.py --shapes qwen3-30b-a3b,deepseek-v3
    python benchmarks/host_path.py --shapes qwen3-30b-a3b --fuse-wgrad --profile-host 20

``--profile-host N`` runs N synchronised steps under cProfile and prints the functions with the
most host time of their own: where the host's path goes, function by function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
        if a.profile_host:
            print(f"== host profile, {name}, {a.profile_host} steps", flush=True)
            print(profile_host(layer, x, go, a.profile_host), flush=True)
        del layer, x, go
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
