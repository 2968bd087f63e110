"""The layer's bandwidth-bound kernels alone: achieved TB/s against a device copy of the same size.

Per benchmark shape, on a random (about balanced) routing: the row scatter (token order to
expert order: the forward's permute and the combine's backward), the gather-sum (the combine and
the permute's backward), the weighted SwiGLU forward and backward. Each is timed with the protocol's
timer (median of 20 after warm-up, CUDA events) and its bytes (each buffer read or written once)
are divided by that time; ``copy`` is ``torch.Tensor.copy_`` of an R x H buffer, the ceiling for a
half-read half-written pass, and ``write`` (``fill_``) and ``read`` (``sum``) the one-sided ones.

    PYTHONPATH=benchmarks python3 benchmarks/probes/row_kernels.py --shapes qwen3-30b-a3b,deepseek-v3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import peers  # noqa: E402  (benchmarks/peers.py: shapes, the timer)

from lightning_moe.ops.backend import csrc_extension  # noqa: E402
from lightning_moe.ops.permute import build_permutation  # noqa: E402


def run_shape(name: str) -> list[dict]:
    T, H, F, E, k = peers.SHAPES[name]
    dev, bf = "cuda", torch.bfloat16
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices
    perm = build_permutation(ids, E, dropless=True)
    R = perm.num_rows
    slot_row = perm.slot_row_TK.int().contiguous()
    x = torch.randn(T, H, device=dev, dtype=bf)
    y = torch.randn(R, H, device=dev, dtype=bf)
    h = torch.randn(R, 2 * F, device=dev, dtype=bf)
    ga = torch.randn(R, F, device=dev, dtype=bf)
    w = torch.rand(R, device=dev)
    ext = csrc_extension(x)
    if ext is None:
        raise SystemExit("the csrc extension is unavailable here")
    copy_dst = torch.empty_like(y)
    arms = {
        "copy R x H": (lambda: copy_dst.copy_(y), 2 * R * H * 2),
        "write R x H (fill)": (lambda: copy_dst.fill_(1.0), R * H * 2),  # the scatter is 8/9 writes
        "read R x H (sum)": (lambda: y.sum(dtype=torch.float32), R * H * 2),  # the gather-sum 8/9 reads
        "scatter x -> rows": (lambda: ext.scatter_rows(x, slot_row, R), (T + R) * H * 2),
        "gather-sum rows -> x": (lambda: ext.unpermute_sum(y, slot_row, None), (T + R) * H * 2),
        "swiglu fwd": (lambda: ext.weighted_swiglu_fwd(h, w), R * 3 * F * 2 + R * 4),
        "swiglu bwd": (lambda: ext.weighted_swiglu_bwd(h, w, ga, True), R * 5 * F * 2 + R * 8),
    }
    rows = []
    for arm, (fn, nbytes) in arms.items():
        ms = peers.timeit(fn, 3, 20)
        row = {"shape": name, "arm": arm, "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("row_kernels.py times CUDA kernels; no GPU is visible.")
    rows = [r for name in a.shapes.split(",") for r in run_shape(name)]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
