"""lightning-moe's layer step under several kernel settings, interleaved in one process.

On one H200 the layer step holds the chip at its power cap (``benchmarks/clock_probe.py``), so a
kernel raced alone, at whatever clock its own power allows, can rank differently inside the step,
where the bandwidth-bound kernels around it draw less. This times the fused-wgrad layer step
(synchronised, CUDA events, as ``benchmarks/moe_layer.py``) under each arm's environment
settings, a few steps of each arm in turn for several rounds, so clock drift falls on all alike.

An arm is ``label:NAME=VALUE+NAME=VALUE`` (environment variables read by the layer's ops on every
forward: ``LIGHTNING_MOE_GEMM_KERNEL``, ``LIGHTNING_MOE_GEMM_CUTLASS_TILE``,
``LIGHTNING_MOE_WGRAD_KERNEL``, ``LIGHTNING_MOE_WGRAD_CUTLASS_TILE``); a label starting with
``fresh`` also sets every parameter's ``.grad`` to ``None`` before each step (no accumulation).

    python benchmarks/layer_arms.py --shape qwen3-30b-a3b \\
        --arms "default:,gemm-coop:LIGHTNING_MOE_GEMM_KERNEL=cutlass+LIGHTNING_MOE_GEMM_CUTLASS_TILE=cooperative-128x256-c2x1"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (benchmarks/peers.py: shapes)
from gpu_clocks import ClockSampler  # noqa: E402
from moe_layer import environment, ours, skewed_input  # noqa: E402


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    label, _, settings = spec.partition(":")
    env = {}
    for item in filter(None, settings.split("+")):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"arm {spec!r}: setting {item!r} is not NAME=VALUE")
        env[name.strip()] = value.strip()
    return label.strip(), env


def run(shape: str, specs: list[str], rounds: int, steps: int) -> list[dict]:
    T, H, Fh, E, k = peers.SHAPES[shape]
    layer = ours(H, Fh, E, k, "cuda", 0.0, fuse_wgrad=True)
    x = skewed_input(T, H, "cuda", 0.0).requires_grad_(True)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    arms = [parse_arm(s) for s in specs]
    times: dict[str, list[float]] = {label: [] for label, _ in arms}
    windows: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in arms}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ClockSampler() as clocks:
        for _ in range(rounds):
            for label, env in arms:
                with environment(env):
                    for i in range(steps + 2):  # two warm-up steps after switching
                        if label.startswith("fresh"):
                            for p in layer.parameters():
                                p.grad = None
                        x.grad = None
                        t0 = time.time()
                        s.record()
                        layer(x).backward(go)
                        e.record()
                        torch.cuda.synchronize()
                        if i >= 2:
                            times[label].append(s.elapsed_time(e))
                            windows[label].append((t0, time.time()))
    base = statistics.median(times[arms[0][0]])
    rows = []
    for label, env in arms:
        ms = statistics.median(times[label])
        inside = [smp for t0, t1 in windows[label] for smp in clocks.window(t0, t1)]
        row = {"shape": shape, "arm": label, "ms": round(ms, 3), "vs_first": round(ms / base, 3), "env": env}
        if inside:
            row["sm_mhz"] = round(statistics.median(smp[1] for smp in inside))
            row["power_w"] = round(statistics.median(smp[2] for smp in inside))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(peers.SHAPES))
    ap.add_argument("--arms", required=True, help="comma-separated label:NAME=VALUE+NAME=VALUE")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = run(a.shape, [s for s in a.arms.split(",") if s.strip()], a.rounds, a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
