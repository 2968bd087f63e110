"""One MoE layer step in FP8 beside the same layer in bf16, in one process (``moe_layer.py``'s protocol).

For every shape: our bf16 layer (weight gradients added into ``.grad``), then one row per FP8
recipe (``MoEConfig(fp8=Fp8Config(recipe=...))``) and one for ``enabled="auto"``; each row gives
step ms, the activation peak, the ratio bf16 ms / FP8 ms and the peak ratio FP8 / bf16, and the
FP8 layer's output error relative to the bf16 layer's on the same weights and input
(``|y_fp8 - y_bf16| / |y_bf16|``, Frobenius norms, and the cosine distance).

    python benchmarks/fp8_layer.py                                  # the three shapes, every recipe
    python benchmarks/fp8_layer.py --shapes deepseek-v3 --recipes blockwise --json out.json
    python benchmarks/fp8_layer.py --quick                          # tiny shape, emulated FP8 (CPU smoke)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moe_layer  # noqa: E402  (bench(), the shared protocol)
import peers  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma list; 'auto' adds an enabled='auto' row")
    ap.add_argument("--no-auto", action="store_true", help="leave out the enabled='auto' row")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
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
        arms = [(r, Fp8Config(recipe=r, backend=backend)) for r in a.recipes.split(",") if r]
        if not a.no_auto:
            arms.append(("auto", Fp8Config(recipe="blockwise", enabled="auto", backend=backend)))
        for name, fp8 in arms:
            r = moe_layer.bench(f"fp8[{name}]", lambda fp8=fp8: build(H, Fh, E, k, dev, fp8, True), T, H, dev, flops, 0.0)
            r["shape"] = sname
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
