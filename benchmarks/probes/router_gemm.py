"""The router's logits GEMM alone: the csrc kernel (64- and 128-token tiles) beside cuBLAS.

Per benchmark shape: ``logits[T, E] = x[T, H] @ w[E, H]^T`` with fp32 output, device ms
(median of 20, CUDA events) of ``torch.ops.lightning_moe_C.router_logits`` at each tile and of
``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS), plus the largest deviation from the latter.

    PYTHONPATH=benchmarks python3 benchmarks/probes/router_gemm.py --shapes qwen3-30b-a3b deepseek-v3 mixtral-8x7b
"""

from __future__ import annotations

import argparse
import json

import torch

import peers  # noqa: E402  (SHAPES, timeit)

from lightning_moe.ops.build import load_extension  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
    args = parser.parse_args()
    ext = load_extension(mode="csrc")
    for name in args.shapes:
        T, H, _, E, _ = peers.SHAPES[name]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = torch.mm(x, w.t(), out_dtype=torch.float32)
        row: dict = {"shape": name, "cublas_ms": round(peers.timeit(lambda: torch.mm(x, w.t(), out_dtype=torch.float32), 5, 20), 4)}
        for tile in (64, 128):
            out = ext.router_logits(x, w, tile)
            row[f"csrc_{tile}_ms"] = round(peers.timeit(lambda tile=tile: ext.router_logits(x, w, tile), 5, 20), 4)
            row[f"csrc_{tile}_max_abs_dev"] = float((out - ref).abs().max())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
