"""Forward / data-gradient expert GEMMs: one grouped GEMM vs one cuBLAS GEMM per expert over N streams.

``--dgrad`` adds the two data-gradient GEMMs; every GEMM also runs with the weight stored K-major
(the layer's forward reads its weights N-major, its data gradient K-major).

Per shape and projection (``y_e = x_e @ w[e]`` for every expert, as the forward and the data
gradient of a benchmark layer run them): ``F.grouped_mm`` against a per-expert ``torch.mm``
loop with experts dealt round-robin over 1, 2 and 4 streams, and every tiling of the CUTLASS
grouped GEMM (``ops/grouped_gemm_cutlass.py``; skipped, saying why, where it cannot run) on both
weight layouts, each with its largest relative error against ``F.grouped_mm`` on the same layout.
Prints ms (median of 10, CUDA events) and TFLOP/s; ``--json`` writes the rows.

    PYTHONPATH=benchmarks python3 benchmarks/probes/expert_gemms.py --shapes deepseek-v3 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from wgrad_kernels import SHAPES, _routed_offsets, _time_ms

from lightning_moe.ops import build_cutlass, grouped_gemm_cutlass


def _loop(x: torch.Tensor, w: torch.Tensor, bounds: list[int], out: torch.Tensor, lanes: list[torch.cuda.Stream]) -> None:
    main = lanes[0]
    for side in lanes[1:]:
        side.wait_stream(main)
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            with torch.cuda.stream(lanes[e % len(lanes)]):
                torch.mm(x[lo:hi], w[e], out=out[lo:hi])
    for side in lanes[1:]:
        main.wait_stream(side)


def _max_rel_err(got: torch.Tensor, want: torch.Tensor, rows: int) -> float:
    """Largest |got - want| / max |want| over the routed rows (the rest are never written)."""
    got, want = got[:rows].float(), want[:rows].float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _cutlass_arms(
    label: str, x: torch.Tensor, weights: dict[str, torch.Tensor], offs_d: torch.Tensor
) -> dict[str, tuple[Callable[[], object], float]]:
    """``{arm: (fn, max rel err vs F.grouped_mm)}`` for every CUTLASS tiling on each weight layout
    (``weights``: arm-name suffix → w); a layout the kernel cannot take prints why, once."""
    arms: dict[str, tuple[Callable[[], object], float]] = {}
    R = int(offs_d[-1])
    for layout, w in weights.items():
        if not grouped_gemm_cutlass.supported(x, w):
            reason = build_cutlass.cutlass_unavailable_reason() or "shape or layout not supported"
            print(json.dumps({"gemm": label, "arm": f"cutlass{layout}", "error": reason}), flush=True)
            continue
        want = F.grouped_mm(x, w, offs=offs_d)
        for tiling in grouped_gemm_cutlass.TILES:
            arm = f"cutlass {tiling}{layout}"
            fn = functools.partial(grouped_gemm_cutlass.grouped_mm, x, w, offs_d, tiling=tiling)
            try:  # one tiling refused at run time (CUTLASS's can_implement) must not cost the others
                arms[arm] = (fn, _max_rel_err(fn(), want, R))
            except RuntimeError as err:
                print(json.dumps({"gemm": label, "arm": arm, "error": str(err)[:300]}), flush=True)
    return arms


def run(label: str, offs: torch.Tensor, K: int, N: int, loops: bool = True) -> list[dict]:
    dev = torch.device("cuda")
    R = int(offs[-1])
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(offs.numel(), K, N, device=dev, dtype=torch.bfloat16) * 0.02
    offs_d, bounds = offs.to(dev), [0, *offs.tolist()]
    out = torch.empty(R, N, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * R * K * N
    rows = []
    w_k = w.transpose(1, 2).contiguous().transpose(1, 2)  # the same [e, K, N] values, K contiguous
    arms: dict[str, tuple[Callable[[], object], float | None]] = {
        "grouped_mm": (lambda: F.grouped_mm(x, w, offs=offs_d), None),
        "grouped_mm K-major w": (lambda: F.grouped_mm(x, w_k, offs=offs_d), None),
    }
    # The forward reads w N-major, the data gradient K-major: every row times both, labelled.
    arms.update(_cutlass_arms(label, x, {"": w, " K-major w": w_k}, offs_d))
    for n in (1, 2, 4) if loops else ():
        lanes = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(n - 1)]
        loop = functools.partial(_loop, x, w, bounds, out, lanes)
        arms[f"cuBLAS loop {n} streams"] = (loop, None)
    for arm, (fn, err) in arms.items():
        ms = _time_ms(fn)
        row = {"gemm": label, "arm": arm, "ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
        if err is not None:
            row["max_rel_err"] = float(f"{err:.2e}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v3"], choices=sorted(SHAPES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--dgrad", action="store_true", help="also the data-gradient GEMMs (grad_y @ w2^T, grad_h @ w13^T)")
    parser.add_argument("--no-loops", action="store_true", help="grouped arms only (no per-expert cuBLAS loops)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.shapes:
        tokens, hidden, ffn, experts, top_k = SHAPES[name]
        offs = _routed_offsets(tokens, experts, top_k, gen)
        loops = not args.no_loops
        results += run(f"{name} up (x @ w13)", offs, hidden, 2 * ffn, loops)
        results += run(f"{name} down (a @ w2)", offs, ffn, hidden, loops)
        if args.dgrad:
            results += run(f"{name} dgrad down (dy @ w2^T)", offs, hidden, ffn, loops)
            results += run(f"{name} dgrad up (dh @ w13^T)", offs, 2 * ffn, hidden, loops)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
