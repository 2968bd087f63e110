"""The experts alone (``GroupedExperts`` over grouped rows, forward + backward) in bf16 and in FP8, per shape.

The figures behind ``Fp8Config(enabled="auto")``'s rule (``ops.fp8.expert_mlp.fp8_pays``): which
expert shapes H x F run faster with FP8 GEMMs than in bf16 on this GPU. Each arm: bf16 activations
and parameters, the same rows and routing; the median of ``--iters`` timed steps after warm-up.

    python benchmarks/probes/fp8_experts_shapes.py                       # the default shapes
    python benchmarks/probes/fp8_experts_shapes.py --recipes rowwise --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_moe.config import Fp8Config  # noqa: E402
from lightning_moe.moe.experts import GroupedExperts  # noqa: E402

# name: rows in all, hidden H, ffn F, local experts E
SHAPES = {
    "2880x2880": (32768, 2880, 2880, 32),
    "qwen3-30b-a3b": (131072, 2048, 768, 128),
    "deepseek-v3-ep8": (16384, 7168, 2048, 32),
    "4096x1536": (65536, 4096, 1536, 64),
}


def step_ms(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, iters: int) -> float:
    dy = torch.randn_like(x)
    times = []
    for i in range(iters + 3):
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--recipes", default="rowwise,blockwise,tensorwise")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="")
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
                ms = step_ms(experts, x, counts, w, a.iters)
            except (RuntimeError, ValueError) as err:
                print(f"{name:16s} {arm:11s} failed: {str(err).splitlines()[0][:120]}", flush=True)
                continue
            base = ms if arm == "bf16" else base
            speedup = base / ms if base else float("nan")
            rows.append(dict(shape=name, arm=arm, R=R, H=H, F=F, E=E, ms=ms, speedup=speedup))
            print(f"{name:16s} {arm:11s} {ms:8.2f} ms  bf16/this {speedup:5.2f}x", flush=True)
            del experts
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
