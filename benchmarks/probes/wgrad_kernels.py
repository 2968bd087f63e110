"""Expert weight-gradient GEMMs that add into an existing gradient: every implementation, one process.

Per shape (one expert weight of a benchmark layer: ``dw[e] += x_e^T @ dy_e`` over all experts):

* ``grouped fresh``  — ``F.grouped_mm`` into a new buffer (what autograd computes; adds nothing)
* ``grouped + add``  — the same, then ``dw.add_`` (autograd's accumulation into an existing ``.grad``)
* ``cuBLAS loop``    — one ``addmm_`` with beta = 1 per expert (``ops/wgrad/cublas_loop.py``), in one
  stream and over several, plus two layouts of the same GEMMs
* ``cutlass <tiling>`` — the CUTLASS grouped kernel (``ops/wgrad/cutlass_kernel.py``), where it builds

Prints ms (median of 10 after warm-up, CUDA events), TFLOP/s, the bandwidth of reading and writing
the gradient once, and each CUTLASS tiling's largest relative error against an fp32 reference on a
few experts. ``--json`` writes the rows.

    PYTHONPATH=benchmarks python3 benchmarks/probes/wgrad_kernels.py --shapes deepseek-v3 mixtral-8x7b --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_moe.ops import build_cutlass
from lightning_moe.ops.wgrad import accumulate_wgrad_
from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass

import peers  # noqa: E402  (benchmarks/peers.py: the shared timer)

# name: (tokens, hidden, ffn, experts, top_k)
SHAPES = {
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
    "mixtral-8x7b": (16384, 4096, 14336, 8, 2),
}

def _loop_transposed(dw: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, bounds: list[int]) -> None:
    """The cuBLAS loop computing each gradient's transpose (``dw[e]^T += dy_e^T x_e``): another kernel choice."""
    counts = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    for grad_DO, x_RD, dy_RO, rows in zip(dw.unbind(0), x[: bounds[-1]].split(counts), dy[: bounds[-1]].split(counts), counts):
        if rows:
            grad_DO.t().addmm_(dy_RO.t(), x_RD)


def _top_kernels(label: str, arm: str, fn: Callable[[], None]) -> None:
    """GPU time by kernel name over one call (profiler): which kernels, how many, memsets."""
    from profiling import device_kernels  # benchmarks/profiling.py

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [[round(k["total_ms"], 3), k["count"], k["name"][:70]] for k in device_kernels(prof)[:5]]
    print(json.dumps({"weight": label, "profile": arm, "kernels": rows}), flush=True)


def _padded_batched(dw: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, bounds: list[int]) -> Callable[[], None]:
    """One strided-batched cuBLAS GEMM with beta = 1 over rows padded with zeros to the largest
    expert (the padding copies are timed, the index building is not)."""
    E = dw.shape[0]
    counts = torch.tensor([hi - lo for lo, hi in itertools.pairwise(bounds)])
    most = int(counts.max())
    expert = torch.repeat_interleave(torch.arange(E), counts)
    slot = (expert * most + torch.arange(bounds[-1]) - torch.tensor(bounds[:-1])[expert]).to(x.device)
    x_pad = x.new_zeros(E * most, x.shape[1])
    dy_pad = dy.new_zeros(E * most, dy.shape[1])

    def run() -> None:
        x_pad.index_copy_(0, slot, x[: bounds[-1]])
        dy_pad.index_copy_(0, slot, dy[: bounds[-1]])
        dw.baddbmm_(x_pad.view(E, most, -1).transpose(1, 2), dy_pad.view(E, most, -1))

    return run


def _time_ms(fn: Callable[[], None]) -> float:
    """Median ms of 10 runs after 2 warm-up runs (CUDA events): the protocol's timer."""
    return peers.timeit(fn, 2, 10)


def _routed_offsets(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Inclusive row ends of a random router's top-k choices (balanced in expectation)."""
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(choice.flatten(), minlength=experts).cumsum(0).to(torch.int32)


def _max_rel_err(tiling: str, x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, dw: torch.Tensor) -> float:
    """Largest |error| / max |expected| of a CUTLASS tiling over the first few experts, against fp32."""
    few = min(4, offs.numel())
    probe = dw[:few].clone()
    wgrad_cutlass.grouped_wgrad_accumulate_(probe, x, dy, offs[:few].contiguous(), tiling=tiling)
    bounds = [0] + offs[:few].tolist()
    worst = 0.0
    for e in range(few):
        xe, ge = x[bounds[e] : bounds[e + 1]].float(), dy[bounds[e] : bounds[e + 1]].float()
        want = dw[e].float() + xe.t() @ ge
        worst = max(worst, ((probe[e].float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return worst


def run_weight(label: str, rows_offs: torch.Tensor, D: int, O: int, cutlass_only: bool = False) -> list[dict]:
    E, R = rows_offs.numel(), int(rows_offs[-1])
    dev = torch.device("cuda")
    x = torch.randn(R, D, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(R, O, device=dev, dtype=torch.bfloat16) * 0.05
    dw = torch.randn(E, D, O, device=dev, dtype=torch.bfloat16) * 0.01
    offs = rows_offs.to(dev)
    bounds = [0] + rows_offs.tolist()
    flop = 2.0 * R * D * O
    grad_bytes = 2.0 * dw.numel() * dw.element_size()  # the gradient read once and written once
    rows = []

    def record(arm: str, ms: float, err: float | None = None) -> None:
        row = {"weight": label, "arm": arm, "ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
        row["grad_rw_tb_s"] = round(grad_bytes / ms / 1e9, 2)
        if err is not None:
            row["max_rel_err"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)

    record("grouped fresh", _time_ms(lambda: F.grouped_mm(x.t(), dy, offs=offs)))
    record("grouped + add", _time_ms(lambda: dw.add_(F.grouped_mm(x.t(), dy, offs=offs))))
    if cutlass_only:  # the references only: today's default fused kernel, and what autograd does
        record("cuBLAS loop 2 streams", _time_ms(lambda: accumulate_wgrad_(dw, x, dy, bounds, streams=2)))
    else:
        record("cuBLAS loop", _time_ms(lambda: accumulate_wgrad_(dw, x, dy, bounds)))
        record("cuBLAS loop transposed", _time_ms(lambda: _loop_transposed(dw, x, dy, bounds)))
        for n in (2, 3, 4):
            record(f"cuBLAS loop {n} streams", _time_ms(lambda n=n: accumulate_wgrad_(dw, x, dy, bounds, streams=n)))
        record("cuBLAS padded batched", _time_ms(_padded_batched(dw, x, dy, bounds)))
    if wgrad_cutlass.supported(x, dw):
        for tiling in wgrad_cutlass.TILES:
            err = _max_rel_err(tiling, x, dy, offs, dw)
            fn = lambda t=tiling: wgrad_cutlass.grouped_wgrad_accumulate_(dw, x, dy, offs, tiling=t)  # noqa: E731
            record(f"cutlass {tiling}", _time_ms(fn), err)
    else:
        print(json.dumps({"weight": label, "arm": "cutlass", "error": build_cutlass.cutlass_unavailable_reason()}))
    if not cutlass_only:
        _top_kernels(label, "cuBLAS loop", lambda: accumulate_wgrad_(dw, x, dy, bounds))
        _top_kernels(label, "cuBLAS loop 2 streams", lambda: accumulate_wgrad_(dw, x, dy, bounds, streams=2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v3", "mixtral-8x7b"], choices=sorted(SHAPES))
    parser.add_argument("--cutlass-only", action="store_true",
                        help="time the CUTLASS tilings against the grouped GEMM (+ add) and the two-stream loop only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_kernels.py times CUDA kernels; no GPU is visible.")
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.shapes:
        tokens, hidden, ffn, experts, top_k = SHAPES[name]
        offs = _routed_offsets(tokens, experts, top_k, gen)
        results += run_weight(f"{name} w13", offs, hidden, 2 * ffn, args.cutlass_only)
        torch.cuda.empty_cache()
        results += run_weight(f"{name} w2", offs, ffn, hidden, args.cutlass_only)
        torch.cuda.empty_cache()
    for name in args.shapes:  # the CUTLASS tiling with the least time over both weights
        both = {}
        for row in results:
            if row["weight"].startswith(name + " ") and row["arm"].startswith("cutlass "):
                both.setdefault(row["arm"][len("cutlass "):], []).append(row["ms"])
        both = {t: sum(ms) for t, ms in both.items() if len(ms) == 2}
        if both:
            best = min(both, key=both.__getitem__)
            print(f"best cutlass {name}: {both[best]:.2f} ms tiling={best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
