"""The per-expert cuBLAS weight-gradient loop under each of torch's BLAS back ends.

The two-stream loop (``ops/wgrad/cublas_loop.accumulate_wgrad_``: one ``addmm_`` with beta = 1 per
expert) is the fused accumulation for wide experts. Profiled inside the DeepSeek-V3 layer it comes
with one device memset per GEMM (513 a step, ~1.4 ms of GPU time). This times the loop per
weight under ``torch.backends.cuda.preferred_blas_library`` ``cublas`` and ``cublaslt`` and lists
what one call runs on the device (kernel names, counts, ms), so the memsets' source shows.

    python benchmarks/probes/wgrad_blas.py --shape deepseek-v3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
import peers  # noqa: E402  (benchmarks/peers.py: shapes, the timer)
from profiling import device_kernels  # noqa: E402

from lightning_moe.ops.wgrad import accumulate_wgrad_  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v3", choices=sorted(peers.SHAPES))
    ap.add_argument("--backends", default="cublas,cublaslt")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_blas.py times CUDA kernels; no GPU is visible.")
    T, H, F, E, k = peers.SHAPES[a.shape]
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    bounds = [0] + torch.bincount(choice.flatten(), minlength=E).cumsum(0).tolist()
    R = bounds[-1]
    before = torch.backends.cuda.preferred_blas_library()
    try:
        for weight, (D, O) in {"w13": (H, 2 * F), "w2": (F, H)}.items():
            x = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(R, O, device="cuda", dtype=torch.bfloat16) * 0.05
            dw = torch.randn(E, D, O, device="cuda", dtype=torch.bfloat16) * 0.01
            for backend in a.backends.split(","):
                torch.backends.cuda.preferred_blas_library(backend)
                run = lambda: accumulate_wgrad_(dw, x, dy, bounds, streams=2)  # noqa: E731
                ms = peers.timeit(run, 2, 10)
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run()
                    torch.cuda.synchronize()
                kernels = [[round(r["total_ms"], 3), r["count"], r["name"][:60]] for r in device_kernels(prof)[:5]]
                print(json.dumps({"shape": a.shape, "weight": weight, "backend": backend, "ms": round(ms, 3),
                                  "kernels": kernels}), flush=True)
            del x, dy, dw
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.preferred_blas_library(before)


if __name__ == "__main__":
    main()
