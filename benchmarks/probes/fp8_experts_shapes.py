"""The experts alone (``GroupedExperts`` over grouped rows, forward + backward) in bf16 and in FP8, per shape.

The figures behind ``Fp8Config(enabled="auto")``'s rule (``ops.fp8.expert_mlp.fp8_pays``): which
expert shapes H x F run faster with FP8 GEMMs than in bf16 on this GPU. Each arm: bf16 activations
and parameters, the same rows and routing; the median of ``--iters`` timed steps after warm-up.

    PYTHONPATH=benchmarks python3 benchmarks/probes/fp8_experts_shapes.py                       # the default shapes
    PYTHONPATH=benchmarks python3 benchmarks/probes/fp8_experts_shapes.py --recipes rowwise --json out.json
    PYTHONPATH=benchmarks python3 benchmarks/probes/fp8_experts_shapes.py --profile             # + the top CUDA kernels of one step per arm
    PYTHONPATH=benchmarks python3 benchmarks/probes/fp8_experts_shapes.py --fresh-weights       # FP8 weights quantized in every step

Without ``--fresh-weights`` the FP8 weight copies (``Fp8Config(cache_weights=True)``) are made in
the warm-up and reused by every timed step, as across the micro-batches of one optimizer step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


from profiling import device_kernels  # noqa: E402  (benchmarks/profiling.py)

from lightning_moe.config import Fp8Config  # noqa: E402
from lightning_moe.moe.experts import GroupedExperts  # noqa: E402

# name: rows in all, hidden H, ffn F, local experts E
SHAPES = {
    "2880x2880": (32768, 2880, 2880, 32),
    "qwen3-30b-a3b": (131072, 2048, 768, 128),
    "deepseek-v3-ep8": (16384, 7168, 2048, 32),
    "4096x1536": (65536, 4096, 1536, 64),
}


def _mark_weights_changed(experts: GroupedExperts) -> None:
    """A version bump of the expert weights (no kernel): the FP8 weight cache quantizes them again."""
    for p in experts.parameters():
        torch.autograd.graph.increment_version(p)


def step_ms(
    experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, iters: int, fresh: bool = False
) -> float:
    dy = torch.randn_like(x)
    times = []
    for i in range(iters + 3):
        if fresh:
            _mark_weights_changed(experts)
        xr = x.detach().requires_grad_(True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        experts(xr, counts, w).backward(dy)
        end.record()
        torch.cuda.synchronize()
        experts.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_kernels(
    experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, fresh: bool, top: int = 15
) -> list[list]:
    """The CUDA kernels of one forward + backward (after the timed steps): ``[ms, calls, name]``, longest first."""
    from torch.profiler import ProfilerActivity, profile

    dy = torch.randn_like(x)
    if fresh:
        _mark_weights_changed(experts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        experts(x.detach().requires_grad_(True), counts, w).backward(dy)
        torch.cuda.synchronize()
    experts.zero_grad(set_to_none=True)
    rows = device_kernels(prof)
    total = sum(r["total_ms"] for r in rows)
    return [[round(total, 3), 0, "(all kernels)"]] + [[round(r["total_ms"], 3), r["count"], r["name"][:100]] for r in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--recipes", default="rowwise,blockwise,tensorwise")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step of each arm")
    ap.add_argument("--fresh-weights", action="store_true", help="requantize the FP8 weights in every step")
    a = ap.parse_args()
    rows = []
    for name in a.shapes.split(","):
        R, H, F, E = SHAPES[name]
        torch.manual_seed(0)
        counts = torch.full((E,), R // E, device="cuda")
        x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(R, device="cuda")
        arms: list[tuple[str, Fp8Config | None]] = [("bf16", None)]
        arms += [(r, Fp8Config(recipe=r)) for r in a.recipes.split(",")]
        base = None
        for arm, fp8 in arms:
            experts = GroupedExperts(E, H, F, fp8=fp8).cuda().to(torch.bfloat16)
            try:
                ms = step_ms(experts, x, counts, w, a.iters, a.fresh_weights)
            except (RuntimeError, ValueError) as err:
                print(f"{name:16s} {arm:11s} failed: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            base = ms if arm == "bf16" else base
            speedup = base / ms if base else float("nan")
            rows.append(dict(shape=name, arm=arm, R=R, H=H, F=F, E=E, ms=ms, speedup=speedup))
            print(f"{name:16s} {arm:11s} {ms:8.2f} ms  bf16/this {speedup:5.2f}x", flush=True)
            if a.profile:
                rows[-1]["kernels_ms"] = step_kernels(experts, x, counts, w, a.fresh_weights)
                for kms, n, kname in rows[-1]["kernels_ms"]:
                    print(f"   {kms:8.3f} ms {n:5d}x  {kname}", flush=True)
            del experts
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
