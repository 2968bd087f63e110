"""The fused weight-gradient kernels timed inside the layer's step (CUDA events, no profiler).

``wgrad_kernels.py`` times each kernel alone on random data; this times the same kernels where
they run, inside a fused-wgrad layer step, so a kernel that is fast alone but slows the step can
be told apart from one that is slow itself. Arms are interleaved (a few steps of each, in turn)
so clock and power drift fall on all of them alike. For every arm: the step, each weight's
accumulation (an event pair on the current stream around the call; the two-stream loop joins
its side stream before returning), and the rest of the step.

Arms: ``streams``, ``cutlass@<tiling>``, and ``w2=cutlass@<tiling>`` (w13 over the two-stream
loop, w2 through CUTLASS).

    PYTHONPATH=benchmarks python3 benchmarks/probes/wgrad_in_layer.py --shape deepseek-v3 --arms streams,cutlass@cooperative-c1x2,w2=cutlass@cooperative-c1x2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import peers  # noqa: E402  (benchmarks/peers.py: shapes)
from moe_layer import ours  # noqa: E402

import lightning_moe.ops.wgrad as wacc  # noqa: E402
from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass  # noqa: E402


class _Arm:
    """One way of accumulating the weight gradients: the forward's ``KernelConfig.wgrad``, and a w2 override."""

    def __init__(self, spec: str) -> None:
        self.name = spec
        self.w2_cutlass_tile: str | None = None
        if spec.startswith("w2=cutlass@"):  # w13: the two-stream loop; w2: CUTLASS with this tiling
            self.kernel, self.tile, self.w2_cutlass_tile = "streams", "", spec.split("@", 1)[1]
            if self.w2_cutlass_tile not in wgrad_cutlass.TILES:
                raise SystemExit(f"--arms: tiling {self.w2_cutlass_tile!r} is unknown; choose one of {tuple(wgrad_cutlass.TILES)}")
        else:
            self.kernel, _, self.tile = spec.partition("@")
            if self.kernel not in wacc.WGRAD_KERNELS:
                raise SystemExit(f"--arms: {spec!r} is not streams, loop, cutlass@<tiling> or w2=cutlass@<tiling>")

    def forward_kernel(self) -> str:
        """What the forward asks for (``moe_layer.py``'s ``kernel[@tiling]``); the w2 override acts in backward."""
        return self.kernel if self.w2_cutlass_tile is not None or not self.tile else f"{self.kernel}@{self.tile}"


def with_wgrad_kernel(spec: str):  # noqa: ANN202
    """A forward call running the layer's experts with ``KernelConfig.wgrad`` = ``kernel`` of ``kernel[@tiling]``."""
    kernel, _, tiling = spec.partition("@")
    if tiling and tiling not in wgrad_cutlass.TILES:
        raise SystemExit(f"--arms: tiling {tiling!r} is not built; choose one of {tuple(wgrad_cutlass.TILES)}")

    def call(m, x):  # noqa: ANN001, ANN202
        before, m.experts.wgrad_kernel = m.experts.wgrad_kernel, kernel
        try:
            return m(x)
        finally:
            m.experts.wgrad_kernel = before

    return call


def run(shape: str, specs: list[str], rounds: int, steps_per_round: int) -> list[dict]:
    T, H, Fh, E, k = peers.SHAPES[shape]
    arms = [_Arm(s) for s in specs]
    layer = ours(H, Fh, E, k, "cuda", 0.0, fuse_wgrad=True)
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    original = wacc.WgradFusion.accumulate_
    current: dict = {"arm": None, "events": []}

    def timed(self: wacc.WgradFusion, grad: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, weight: str) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        arm: _Arm = current["arm"]
        if weight == "w2" and arm.w2_cutlass_tile is not None:
            wgrad_cutlass.grouped_wgrad_accumulate_(grad, x_RD, dy_RO, self.offs_E, arm.w2_cutlass_tile)
        else:
            original(self, grad, x_RD, dy_RO, weight)
        end.record()
        current["events"].append((weight, start, end))

    wacc.WgradFusion.accumulate_ = timed  # type: ignore[method-assign]
    samples: dict[str, dict[str, list[float]]] = {a.name: {"step": [], "w13": [], "w2": []} for a in arms}
    try:
        for r in range(rounds + 1):  # round 0 warms every arm up (grads exist from then on)
            for arm in arms:
                current["arm"] = arm
                forward = with_wgrad_kernel(arm.forward_kernel())
                for _ in range(steps_per_round):
                    current["events"] = []
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    forward(layer, x).backward(go)
                    end.record()
                    torch.cuda.synchronize()
                    if r == 0:
                        continue
                    samples[arm.name]["step"].append(start.elapsed_time(end))
                    for weight, s, e in current["events"]:
                        samples[arm.name][weight].append(s.elapsed_time(e))
    finally:
        wacc.WgradFusion.accumulate_ = original  # type: ignore[method-assign]
    rows = []
    for arm in arms:
        med = {key: statistics.median(v) if v else float("nan") for key, v in samples[arm.name].items()}
        row = {"shape": shape, "arm": arm.name, "steps": len(samples[arm.name]["step"])}
        row.update({f"{key}_ms": round(v, 3) for key, v in med.items()})
        row["rest_ms"] = round(med["step"] - med["w13"] - med["w2"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v3", choices=sorted(peers.SHAPES))
    ap.add_argument("--arms", default="streams,cutlass@cooperative-c1x2,w2=cutlass@cooperative-c1x2")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_in_layer.py times CUDA kernels inside a layer step; no GPU is visible.")
    rows = run(a.shape, [s for s in a.arms.split(",") if s], a.rounds, a.steps_per_round)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
