"""Token exchange on its own: parity and bandwidth of the EP dispatchers (all-to-all, DeepEP, Hybrid-EP).

Every rank of ``torchrun --nproc_per_node=P`` is one EP rank holding
``E / P`` experts; each feeds its own ``--tokens`` tokens, routed top-``K`` by random logits (no
expert twice per token), through each dispatcher named in ``--dispatchers``:

* ``alltoall``: :class:`~lightning_moe.moe.dispatch.alltoall.AllToAllDispatcher` (NCCL uneven
  all-to-all; one row per routed slot).
* ``alltoall_dedup``: :class:`~lightning_moe.moe.dispatch.flex.FlexDispatcher` over
  :class:`~lightning_moe.moe.dispatch.exchange_alltoall_dedup.AllToAllTokenExchange` (NCCL, one row per
  destination rank).
* ``deepep`` / ``hybridep``: :class:`~lightning_moe.moe.dispatch.flex.FlexDispatcher` over
  DeepEP's normal-mode ``Buffer`` / ``HybridEPBuffer`` (one row per destination rank).

**Parity** (no single-process run needed: the check is local and exact up to bf16). The "experts"
scale each row by ``s[g] = 1 + g / E`` (``g`` its global expert), so the layer's output is known in
closed form on the token's own rank: ``y_t = sum_k w_tk s[id_tk] x_t``, and for the upstream
gradient ``G``: ``dx_t = sum_k w_tk s[id_tk] G_t``, ``dw_tk = s[id_tk] <x_t, G_t>``. Each
dispatcher's ``y``, ``dx`` and ``dw`` (autograd through dispatch and combine) are compared with
those (max error relative to the reference's largest magnitude, fp32 accumulation of bf16 inputs),
and the rows the experts received with the router's count for this rank. ``--check`` exits
non-zero when any error passes ``--tol``.

**Bandwidth**: the median over ``--iters`` of ``dispatch`` alone and ``combine`` alone (forward,
CUDA events, a barrier before each), and of the round trip with its backward. ``dispatch_gb_s``
and ``combine_gb_s`` count the *payload*: each (token, destination rank) pair once, ``H`` bf16
values, what every rank receives in dispatch (and sends back in combine); a dispatcher that sends
a token once per slot moves more bytes for the same payload, which is the point of comparing.
``nccl_a2a_gb_s``: a plain ``all_to_all_single`` of the same payload (even splits), the link's
reference. JSON from rank 0 (every rank's medians, their max reported).

    torchrun --nproc_per_node=2 benchmarks/dispatch_exchange.py --dispatchers alltoall,deepep,hybridep \\
        --check --out exchange.json
    torchrun --nproc_per_node=2 benchmarks/dispatch_exchange.py --quick --check   # CPU, gloo, alltoall
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch
import torch.distributed as dist


from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.flex import FlexDispatcher

__all__ = ["build_dispatcher", "closed_form", "main", "routed_tokens"]

SHAPES = {  # tokens per rank, hidden, experts, top-k
    "deepseek-v3": (4096, 7168, 256, 8),
    "qwen3-30b-a3b": (8192, 2048, 128, 8),
}
QUICK = (64, 32, 8, 2)


def build_dispatcher(kind: str, num_experts: int, group: dist.ProcessGroup) -> Any:
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group=group)
    if kind == "alltoall_dedup":
        from lightning_moe.moe.dispatch.exchange_alltoall_dedup import AllToAllTokenExchange

        return FlexDispatcher(num_experts, ep_group=group, exchange=AllToAllTokenExchange(group))
    if kind == "deepep":
        from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange, make_deep_ep_buffer

        return FlexDispatcher(num_experts, ep_group=group, exchange=DeepEPExchange(make_deep_ep_buffer(group)))
    if kind == "hybridep":
        from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange

        return FlexDispatcher(num_experts, ep_group=group, exchange=HybridEPExchange(group, num_experts))
    raise ValueError(f"dispatch_exchange: dispatcher={kind!r} is not known; use alltoall, deepep or hybridep.")


def routed_tokens(
    tokens: int, hidden: int, experts: int, top_k: int, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_TH``, ``ids_TK`` (distinct per token), fp32 ``w_TK`` (softmax over the chosen), upstream ``G_TH``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=g)
    top, ids = logits.topk(top_k, dim=1)
    grad = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    return x, ids.to(device), top.softmax(dim=1).to(device), grad


def expert_scales(experts: int, device: torch.device) -> torch.Tensor:
    return 1.0 + torch.arange(experts, device=device, dtype=torch.float32) / experts


def closed_form(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output and gradients when expert ``g`` multiplies its rows by ``scales[g]`` (fp32)."""
    factor_T = (w * scales[ids]).sum(dim=1, keepdim=True)
    x32, g32 = x.float(), grad.float()
    return factor_T * x32, factor_T * g32, scales[ids] * (x32 * g32).sum(dim=1, keepdim=True)


def _local_expert_of_rows(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    local = torch.arange(tokens_per_expert.numel(), device=tokens_per_expert.device)
    return local.repeat_interleave(tokens_per_expert.long(), output_size=rows)


def _round_trip(dispatcher: Any, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, scales_e: torch.Tensor) -> tuple:
    tokens, handle = dispatcher.dispatch(x, ids, w, None)
    rows = tokens.x_RH.shape[0]
    scale_R = scales_e[_local_expert_of_rows(tokens.tokens_per_expert_e, rows)]
    y_RH = (tokens.x_RH.float() * scale_R[:, None]).to(x.dtype)
    return dispatcher.combine(y_RH, handle, weighted=True), tokens


def check_parity(dispatcher: Any, inputs: tuple, experts: int, rank: int, ep: int) -> dict[str, float]:
    x, ids, w, grad = inputs
    scales = expert_scales(experts, x.device)
    e = experts // ep
    x_ = x.clone().requires_grad_(True)
    w_ = w.clone().requires_grad_(True)
    y, tokens = _round_trip(dispatcher, x_, ids, w_, scales[rank * e : (rank + 1) * e])
    y.backward(grad)
    want_y, want_dx, want_dw = closed_form(x, ids, w, grad, scales)
    counts = torch.bincount(ids.flatten(), minlength=experts).to(torch.int64)
    dist.all_reduce(counts, group=dispatcher.ep_group)
    rows_want = int(counts[rank * e : (rank + 1) * e].sum())

    def err(got: torch.Tensor | None, want: torch.Tensor) -> float:
        if got is None:
            return float("inf")
        return float((got.detach().float() - want).abs().max() / want.abs().max().clamp(min=1e-12))

    return {
        "y_err": err(y, want_y),
        "dx_err": err(x_.grad, want_dx),
        "dw_err": err(w_.grad, want_dw),
        "rows": int(tokens.x_RH.shape[0]),
        "rows_expected": rows_want,
    }


def _timed(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int, group: dist.ProcessGroup) -> float:
    """Median milliseconds of ``fn`` (a barrier before each call, so every rank starts together)."""
    times: list[float] = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def payload_bytes(ids: torch.Tensor, experts: int, ep: int, hidden: int, group: dist.ProcessGroup) -> int:
    """Bytes this rank receives in dispatch with every (token, destination rank) pair sent once (bf16)."""
    e = experts // ep
    sends_P = torch.stack([((ids // e) == p).any(dim=1).sum() for p in range(ep)]).to(torch.int64)
    received_P = torch.empty_like(sends_P)
    dist.all_to_all_single(received_P, sends_P, group=group)
    return int(received_P.sum()) * hidden * 2


def measure(dispatcher: Any, inputs: tuple, experts: int, rank: int, ep: int, iters: int, warmup: int) -> dict:
    x, ids, w, grad = inputs
    group = dispatcher.ep_group
    scales_e = expert_scales(experts, x.device)[rank * (experts // ep) : (rank + 1) * (experts // ep)]
    state: dict[str, Any] = {}

    def dispatch() -> None:
        state["tokens"], state["handle"] = dispatcher.dispatch(x, ids, w, None)

    def combine() -> None:
        dispatcher.combine(state["tokens"].x_RH, state["handle"], weighted=True)

    def round_trip() -> None:
        x_ = x.detach().requires_grad_(True)
        y, _ = _round_trip(dispatcher, x_, ids, w, scales_e)
        y.backward(grad)

    dispatch()
    return {
        "dispatch_ms": _timed(dispatch, x.device, iters, warmup, group),
        "combine_ms": _timed(combine, x.device, iters, warmup, group),
        "round_trip_fwd_bwd_ms": _timed(round_trip, x.device, iters, warmup, group),
    }


def nccl_a2a_ms(payload: int, device: torch.device, iters: int, warmup: int, group: dist.ProcessGroup) -> float:
    ep = group.size()
    chunk = max(payload // 2 // ep, 1)
    send = torch.ones(chunk * ep, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    return _timed(lambda: dist.all_to_all_single(recv, send, group=group), device, iters, warmup, group)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rank, ep = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, hidden, experts, top_k = QUICK if args.quick else SHAPES[args.shape]
    inputs = routed_tokens(tokens, hidden, experts, top_k, args.seed + rank, device, dtype)
    group = dist.group.WORLD
    payload = payload_bytes(inputs[1], experts, ep, hidden, group)
    report: dict[str, Any] = {"shape": "quick" if args.quick else args.shape, "ep": ep, "tokens_per_rank": tokens,
                              "hidden": hidden, "experts": experts, "top_k": top_k, "dtype": str(dtype),
                              "payload_mb_per_rank": payload / 1e6, "rows": {}}  # fmt: skip
    even = int(_max_over_ranks(payload, device))  # one size on every rank: even splits
    a2a = _max_over_ranks(nccl_a2a_ms(even, device, args.iters, args.warmup, group), device)
    report["nccl_a2a_ms"], report["nccl_a2a_gb_s"] = a2a, even / a2a / 1e6
    for kind in args.dispatchers.split(","):
        try:
            dispatcher = build_dispatcher(kind, experts, group)
        except ImportError as err:
            report["rows"][kind] = {"skipped": str(err)}
            continue
        row: dict[str, Any] = check_parity(dispatcher, inputs, experts, rank, ep)
        for key in ("y_err", "dx_err", "dw_err"):
            row[key] = _max_over_ranks(row[key], device)
        row["rows_ok"] = bool(_max_over_ranks(float(row["rows"] != row["rows_expected"]), device) == 0)
        for key, ms in measure(dispatcher, inputs, experts, rank, ep, args.iters, args.warmup).items():
            row[key] = _max_over_ranks(ms, device)
        row["dispatch_gb_s"] = payload / row["dispatch_ms"] / 1e6
        row["combine_gb_s"] = payload / row["combine_ms"] / 1e6
        report["rows"][kind] = row
        if rank == 0:
            print(json.dumps({"dispatcher": kind, **row}), flush=True)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dispatchers", default="alltoall,alltoall_dedup,deepep,hybridep")
    p.add_argument("--shape", default="deepseek-v3", choices=sorted(SHAPES))
    p.add_argument("--quick", action="store_true", help=f"tiny sizes (T, H, E, K) = {QUICK}, for a CPU smoke test")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit non-zero if any parity error exceeds --tol")
    p.add_argument("--tol", type=float, default=2e-2, help="max error relative to the reference's largest value")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    report = run(args)
    failures = [
        f"{kind}: {key}={row[key]:.3g}"
        for kind, row in report["rows"].items()
        for key in ("y_err", "dx_err", "dw_err")
        if key in row and not row[key] <= args.tol
    ] + [f"{kind}: received {row['rows']} rows, the router sent {row['rows_expected']}"
         for kind, row in report["rows"].items() if row.get("rows_ok") is False]  # fmt: skip
    if dist.get_rank() == 0:
        print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    if args.check and failures:
        raise SystemExit("dispatch_exchange: parity failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
