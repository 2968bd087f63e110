"""One expert weight-gradient kernel, run for Nsight Compute to read its hardware counters.

Runs one arm on one weight of a benchmark layer twice (a warm-up, then the launch to profile),
so ``ncu --launch-skip 1 --launch-count 1 -k regex:device_kernel`` catches the second launch:

    ncu --clock-control none -k regex:device_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python benchmarks/probes/wgrad_counters.py --shape deepseek-v3 --weight w13 --arm cutlass:cooperative-c1x2

Arms: ``grouped-fresh`` (``F.grouped_mm`` into a new buffer: the GEMM autograd runs, no addition)
and ``cutlass:<tiling>`` (``ops/wgrad/cutlass_kernel.py``: the old gradient read and added in the
epilogue). What the counters answer: whether the in-place kernel is bound by DRAM, by L2, by the
tensor cores, or by neither (latency: one phase waiting on another).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass

# name: (tokens, hidden, ffn, experts, top_k)
SHAPES = {
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
    "mixtral-8x7b": (16384, 4096, 14336, 8, 2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="deepseek-v3", choices=sorted(SHAPES))
    ap.add_argument("--weight", default="w13", choices=("w13", "w2"))
    ap.add_argument("--arm", default="cutlass:cooperative-c1x2")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_counters.py runs a CUDA kernel; no GPU is visible.")
    tokens, hidden, ffn, experts, top_k = SHAPES[a.shape]
    D, O = (hidden, 2 * ffn) if a.weight == "w13" else (ffn, hidden)
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    offs = torch.bincount(choice.flatten(), minlength=experts).cumsum(0).to(torch.int32).cuda()
    R = tokens * top_k
    x = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(R, O, device="cuda", dtype=torch.bfloat16) * 0.05
    dw = torch.randn(experts, D, O, device="cuda", dtype=torch.bfloat16) * 0.01
    if a.arm == "grouped-fresh":
        run = lambda: F.grouped_mm(x.t(), dy, offs=offs)  # noqa: E731
    elif a.arm.startswith("cutlass:"):
        tiling = a.arm.split(":", 1)[1]
        if tiling not in wgrad_cutlass.TILES:
            raise SystemExit(f"--arm {a.arm}: unknown tiling; choose one of {sorted(wgrad_cutlass.TILES)}")
        if not wgrad_cutlass.supported(x, dw):
            raise SystemExit("the CUTLASS kernels are unavailable here (ops/build_cutlass.py says why)")
        run = lambda: wgrad_cutlass.grouped_wgrad_accumulate_(dw, x, dy, offs, tiling=tiling)  # noqa: E731
    else:
        raise SystemExit(f"--arm {a.arm!r}: use grouped-fresh or cutlass:<tiling>")
    for _ in range(2):  # the warm-up, then the launch ncu profiles
        run()
    torch.cuda.synchronize()
    flop = 2.0 * R * D * O
    print(f"{a.shape} {a.weight} {a.arm}: {flop / 1e12:.2f} TFLOP, gradient {dw.numel() * 2 / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
