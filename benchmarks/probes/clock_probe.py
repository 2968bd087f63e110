"""What the chip's clock does under each arm, and what a step costs synchronised vs back to back.

Each arm runs alone for a while with ``nvidia-smi`` logging the SM clock, the power and the active
clock-event reasons (why the clock is below its maximum) every 20 ms (``gpu_clocks.ClockSampler``),
so the reason is read, not guessed. H200, Qwen3-30B-A3B (2026-11-29): lightning-moe's layer,
the grouped GEMMs alone and the weight-gradient kernels all hold the chip at its power cap
(~690 W, ``sw-power-cap``, 1575–1725 MHz); torch's layer, slowed by its permutation, mostly not
(1980 MHz).

Per arm it also times the step twice: synchronised after every step (the protocol of
``benchmarks/moe_layer.py``: the device idles while the host issues the step's first kernels) and
back to back (the host runs ahead, as in training): their difference is the host-bound share.

    PYTHONPATH=benchmarks python3 benchmarks/probes/clock_probe.py --shape qwen3-30b-a3b --seconds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

import peers  # noqa: E402
from gpu_clocks import ClockSampler, energy_mj, reasons  # noqa: E402
from moe_layer import gemm_operands, gemm_steps, ours, skewed_input  # noqa: E402

from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass  # noqa: E402
from lightning_moe.ops.grouped_gemm import offsets_from_counts  # noqa: E402
from lightning_moe.ops.permute import build_permutation, permute_rows  # noqa: E402

def run_for(step, seconds: float) -> tuple[float, float, list[float], float | None]:  # noqa: ANN001
    """Synchronised steps for ``seconds``: (wall start, wall end, per-step ms by CUDA events, J a step)."""
    e0 = energy_mj()
    t0 = time.time()
    ms = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.time() - t0 < seconds:
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    t1 = time.time()
    e1 = energy_mj()
    joules = (e1 - e0) / 1e3 / len(ms) if e0 is not None and e1 is not None and ms else None
    return t0, t1, ms, joules


def back_to_back_ms(step, steps: int = 20) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        step()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / steps


def arms(shape: str) -> dict:
    T, H, Fh, E, k = peers.SHAPES[shape]
    x = skewed_input(T, H, "cuda", 0.0).requires_grad_(True)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    fused = ours(H, Fh, E, k, "cuda", 0.0, fuse_wgrad=True)
    plain = ours(H, Fh, E, k, "cuda", 0.0)
    ref = peers.GroupedRef(H, Fh, E, k, "cuda")
    with torch.no_grad():
        perm = build_permutation(fused.router(x).topk_ids_TK, E, dropless=True)
    x_RH = permute_rows(x.detach(), perm)
    offs = offsets_from_counts(perm.tokens_per_expert_E)
    w13, w2 = fused.experts.w13.detach(), fused.experts.w2.detach()
    a_RF, h_R2F, g_RH = operands = gemm_operands(x_RH, Fh)
    g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)

    def layer_step(m, fresh: bool = False):  # noqa: ANN001, ANN202
        params = list(m.parameters())

        def step() -> None:
            x.grad = None
            if fresh:
                for p in params:
                    p.grad = None
            m(x).backward(go)

        return step

    def wgrad_cutlass_step() -> None:
        wgrad_cutlass.grouped_wgrad_accumulate_(g13, x_RH, h_R2F, offs)
        wgrad_cutlass.grouped_wgrad_accumulate_(g2, a_RF, g_RH, offs)

    def wgrad_torch_step() -> None:
        g13.add_(F.grouped_mm(x_RH.t(), h_R2F, offs=offs))
        g2.add_(F.grouped_mm(a_RF.t(), g_RH, offs=offs))

    out = {
        "layer-fused-wgrad": layer_step(fused),
        "layer-fused-wgrad-fresh-grads": layer_step(fused, fresh=True),
        "layer-plain": layer_step(plain),
        "torch-grouped_mm-ref": layer_step(ref),
        "gemms-alone": gemm_steps(x_RH, w13, w2, offs, Fh, operands)["all"],
        "wgrad-torch+add": wgrad_torch_step,
    }
    if wgrad_cutlass.supported(x_RH, w13, w2):
        out["wgrad-cutlass"] = wgrad_cutlass_step
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    steps = arms(a.shape)
    windows = {}
    results = []
    with ClockSampler() as smi:
        for name, step in steps.items():
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            time.sleep(0.3)  # a gap between arms so their samples do not mix
            t0, t1, ms, joules = run_for(step, a.seconds)
            windows[name] = (t0 + 0.2, t1)  # the first 0.2 s: the clock settling
            b2b = back_to_back_ms(step)
            results.append({"arm": name, "synced_ms": round(statistics.median(ms), 3), "back_to_back_ms": round(b2b, 3),
                            "joules_per_step": None if joules is None else round(joules, 3)})
    for r in results:
        inside = smi.window(*windows[r["arm"]])
        if inside:
            r["sm_mhz_median"] = statistics.median(s[1] for s in inside)
            r["sm_mhz_min"] = min(s[1] for s in inside)
            r["power_w_median"] = round(statistics.median(s[2] for s in inside))
            r["power_w_max"] = round(max(s[2] for s in inside))
            r["reasons"] = dict(Counter(reasons(s[3]) for s in inside).most_common(4))
            r["samples"] = len(inside)
        print(json.dumps({"shape": a.shape, **r}), flush=True)
    if not smi.samples:
        print("nvidia-smi gave no samples", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
