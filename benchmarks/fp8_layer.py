"""One MoE layer step in FP8 beside the same layer in bf16, in one process (``moe_layer.py``'s protocol).

For every shape: our bf16 layer (weight gradients added into ``.grad``), then one row per FP8
recipe (``MoEConfig(fp8=Fp8Config(recipe=...))``) and one for ``enabled="auto"``; each row gives
step ms, the activation peak, the ratio bf16 ms / FP8 ms and the peak ratio FP8 / bf16, and the
FP8 layer's output error relative to the bf16 layer's on the same weights and input
(``|y_fp8 - y_bf16| / |y_bf16|``, Frobenius norms, and the cosine distance).

    python benchmarks/fp8_layer.py                                  # the three shapes, every recipe
    python benchmarks/fp8_layer.py --shapes deepseek-v3 --recipes blockwise --json out.json
    python benchmarks/fp8_layer.py --quick                          # tiny shape, emulated FP8 (CPU smoke)
    python benchmarks/fp8_layer.py --profile                        # + the top CUDA kernels of one step per arm
    python benchmarks/fp8_layer.py --fresh-weights                  # FP8 weights quantized in every step

The timed steps repeat forward + backward without an optimizer step, so with
``Fp8Config(cache_weights=True)`` (the default) the FP8 weight copies are made once and reused, as
across the micro-batches of one optimizer step. ``--fresh-weights`` bumps the expert weights'
version before every step (no data is touched), so every step quantizes them again: one
micro-batch per optimizer step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


import moe_layer  # noqa: E402  (bench(), the shared protocol)
import peers  # noqa: E402
from profiling import device_kernels  # noqa: E402  (benchmarks/profiling.py)

from lightning_moe import MoELayer  # noqa: E402
from lightning_moe.config import Fp8Config  # noqa: E402

RECIPES = ("blockwise", "rowwise", "tensorwise")


def build(H: int, Fh: int, E: int, k: int, dev: str, fp8: Fp8Config | None, fuse_wgrad: bool) -> MoELayer:
    """``moe_layer.ours`` (the shared protocol's layer, balanced router) with ``fp8``, seeded so that
    every arm gets the same weights."""
    torch.manual_seed(0)
    return moe_layer.ours(H, Fh, E, k, dev, 0.0, fuse_wgrad=fuse_wgrad, fp8=fp8)


def output_error(T: int, H: int, Fh: int, E: int, k: int, dev: str, fp8: Fp8Config) -> tuple[float, float]:
    """``|y_fp8 - y_bf16| / |y_bf16|`` and ``1 - cos(y_fp8, y_bf16)`` of one forward on the same weights and input.

    E4M3 keeps 3 mantissa bits: on random data each quantized operand carries about 2.4 % RMS
    relative error, so two chained GEMMs land near 5 % by the norm ratio; the cosine distance
    (about half its square) is the figure that tracks training quality."""
    x = moe_layer.skewed_input(T, H, dev, 0.0)
    with torch.no_grad():
        ref = build(H, Fh, E, k, dev, None, False)(x).float()
        torch.cuda.empty_cache() if dev == "cuda" else None
        y = build(H, Fh, E, k, dev, fp8, False)(x).float()
    cos = torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0)
    return float((y - ref).norm() / ref.norm()), float(1 - cos)


def fresh_weights_call(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` after marking the expert weights changed (a version bump, no kernel), so that
    the FP8 weight cache quantizes them again, as after an optimizer step."""
    for p in layer.experts.parameters():
        torch.autograd.graph.increment_version(p)
    return layer(x)


def profile_step(make, T: int, H: int, dev: str, call=None, top: int = 15) -> dict:  # noqa: ANN001
    """The CUDA kernels of one forward + backward (after two warm-up steps), longest first:
    ``[[ms, calls, name], ...]`` and their total."""
    if dev != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.cuda.empty_cache()
    mod = make()
    x = moe_layer.skewed_input(T, H, dev, 0.0).requires_grad_(True)
    go = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    fwd = call or (lambda m, x: m(x))
    for _ in range(2):
        fwd(mod, x).backward(go)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd(mod, x).backward(go)
        torch.cuda.synchronize()
    rows = device_kernels(prof)
    del mod
    return {
        "kernels_ms": [[round(r["total_ms"], 3), r["count"], r["name"][:100]] for r in rows[:top]],
        "total_kernel_ms": round(sum(r["total_ms"] for r in rows), 3),
    }


def print_profile(arm: str, prof: dict) -> None:
    if not prof:
        return
    print(f"-- kernels of one step, {arm}: {prof['total_kernel_ms']:.2f} ms in all", flush=True)
    for ms, n, name in prof["kernels_ms"]:
        print(f"   {ms:8.3f} ms {n:5d}x  {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma list; 'auto' adds an enabled='auto' row")
    ap.add_argument("--no-auto", action="store_true", help="leave out the enabled='auto' row")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step of each arm")
    ap.add_argument("--fresh-weights", action="store_true", help="requantize the FP8 weights in every step")
    a = ap.parse_args()
    fp8_call = fresh_weights_call if a.fresh_weights else None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "auto" if dev == "cuda" else "emulate"
    shapes = moe_layer.QUICK if a.quick else peers.SHAPES
    if a.shapes:
        shapes = {n: s for n, s in shapes.items() if n in a.shapes.split(",")}
    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__)
    print(json.dumps(out), flush=True)
    results = []
    for sname, (T, H, Fh, E, k) in shapes.items():
        flops = 18.0 * T * k * H * Fh
        print(f"== {sname}: T={T} H={H} F={Fh} E={E} k={k}", flush=True)
        base = moe_layer.bench("bf16", lambda: build(H, Fh, E, k, dev, None, True), T, H, dev, flops, 0.0)
        base["shape"] = sname
        results.append(base)
        if a.profile:
            base["profile"] = profile_step(lambda: build(H, Fh, E, k, dev, None, True), T, H, dev)
            print_profile("bf16", base["profile"])
        arms = [(r, Fp8Config(recipe=r, backend=backend)) for r in a.recipes.split(",") if r]
        if not a.no_auto:
            arms.append(("auto", Fp8Config(recipe="blockwise", enabled="auto", backend=backend)))
        for name, fp8 in arms:
            make = lambda fp8=fp8: build(H, Fh, E, k, dev, fp8, True)  # noqa: E731
            r = moe_layer.bench(f"fp8[{name}]", make, T, H, dev, flops, 0.0, call=fp8_call)
            r["shape"] = sname
            if a.profile and "error" not in r:
                r["profile"] = profile_step(make, T, H, dev, fp8_call)
                print_profile(f"fp8[{name}]", r["profile"])
            if "ms" in r and base.get("ms"):
                r["speedup_vs_bf16"] = round(base["ms"] / r["ms"], 3)
                if base.get("act_peak_gib"):
                    r["peak_vs_bf16"] = round(r["act_peak_gib"] / base["act_peak_gib"], 3)
                try:
                    rel, cos = output_error(T, H, Fh, E, k, dev, fp8)
                    r["output_rel_err_vs_bf16"], r["output_cos_dist_vs_bf16"] = round(rel, 5), round(cos, 6)
                except Exception as e:  # reported, not hidden
                    r["output_rel_err_vs_bf16"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(r), flush=True)
            results.append(r)
    out["results"] = results
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"\n{'shape':16s} {'arm':16s} {'ms':>8s} {'act GiB':>8s} {'bf16/fp8':>9s} {'peak':>6s} {'out err':>8s} {'1-cos':>9s}")
    for r in results:
        if "error" in r:
            print(f"{r['shape']:16s} {r['peer']:16s} ERROR {r['error'][:90]}")
            continue
        print(f"{r['shape']:16s} {r['peer']:16s} {r['ms']:8.2f} {r['act_peak_gib']:8.2f} "
              f"{r.get('speedup_vs_bf16', 1.0):9.2f} {r.get('peak_vs_bf16', 1.0):6.2f} {r.get('output_rel_err_vs_bf16', '')!s:>8s} {r.get('output_cos_dist_vs_bf16', '')!s:>9s}")  # fmt: skip


if __name__ == "__main__":
    main()
