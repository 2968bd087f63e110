"""EP scaling: a Qwen3-30B-A3B-shaped stack of MoE layers under an EP dispatcher (``--dispatcher``).

Protocol: every rank builds the same stack of ``--layers``
residual MoE FFN layers (``x = x + moe(x)``; hidden 2048, 128 experts, top-8, expert FFN 768,
softmax top-k renormalised, router in fp32, dropless, random router weights so the load is about
balanced), bf16 on CUDA and fp32 on CPU, and feeds it its own ``--tokens`` tokens. The experts
are cut to this rank's ``E/ep`` local experts and every layer's dispatcher is replaced by an
:class:`~lightning_moe.moe.dispatch.alltoall.AllToAllDispatcher` over the EP group, by the
package's own :func:`~lightning_moe.parallel.parallelize.parallelize_moe_model` (``fsdp=False``,
so no FSDP collective is timed) on a :class:`~lightning_moe.parallel.mesh.FoldedMesh` of
``FoldedLayout(world_size=W, ep=--ep)``. With ``ep < W`` the EP groups are the default order's
contiguous blocks (``[0..ep-1]``, ...) and the experts are replicated over ``edp``; with
``ep == 1`` the layer keeps its local fused path (the single-GPU baseline, one process per GPU).

One timed step = forward + backward of the whole stack with a given upstream gradient
(``.grad`` set to None before each step). Warm-up steps, then the median of ``--iters`` (>= 8)
steps, timed with CUDA events on GPU and ``time.perf_counter`` on CPU.

Reported (JSON from rank 0, also printed):

* ``step_ms``: rank 0's median step; ``step_ms_max_rank``: the largest median over all ranks.
* ``tflops_per_gpu``: expert GEMMs only, ``18 * T * K * H * F`` per layer per rank (T tokens per
  rank, K top-k, H hidden, F expert FFN; fwd 6, bwd 12), over rank 0's median step.
* ``a2a_ms`` and ``a2a_share``: the exposed all-to-all. Chosen method: a thin timing wrapper.
  While a second series of steps runs, the name ``dist`` in ``lightning_moe.moe.dispatch.comm`` and
  ``lightning_moe.moe.dispatch.alltoall`` points at a stand-in whose ``all_to_all_single``
  brackets the real call with two CUDA events on the current stream (``perf_counter`` on CPU);
  everything else passes through to ``torch.distributed``. The dispatcher does not overlap its
  exchange with compute, and a blocking NCCL collective makes the compute stream wait for it,
  so the start event fires when the preceding compute is done and the end event when the
  exchange has landed: the interval is the time the compute stream stands idle for the
  exchange, including waiting for slower peers (load imbalance shows up here). It covers the
  count exchange, the row and weight exchanges of dispatch, the combine, and all their
  backward exchanges. The host round trip of the split sizes (``# SYNC`` in the dispatcher)
  is not inside any bracket. With ``--dispatcher deepep`` / ``hybridep`` the library's four
  exchange calls (dispatch, combine and their backward) are bracketed the same way (its kernels
  run on its own stream; the current stream waits for them). ``a2a_share = a2a_ms / step_ms_timed`` where both come from the
  instrumented series (the plain series gives ``step_ms``). This was chosen over replacing the
  exchange by a local copy because a copy changes which rows every rank's experts receive
  (hence the load and the GEMM shapes) and hides the waiting for stragglers, which is part of
  what EP costs.
* ``load_max_over_mean``: tokens (rows) each EP rank's experts receive, per layer, summed over
  the EP group from the router counts of the last step; max/mean over EP ranks, worst layer
  (``load_max_over_mean_per_layer`` lists all). 1.0 means perfectly balanced.
* ``skew`` (``--skew S``, default 0: the random, about balanced router): every layer's router
  gets ``S * 0.02 * d`` added to its first ``E/8`` rows and every rank's input gets ``d`` added,
  ``d`` one seeded direction shared by all ranks (as ``benchmarks/moe_layer.py``), so a few
  experts (hence their EP rank) take most tokens.
* ``echo_spare`` (``--echo-spare N``, default 0: off). With N > 0 (needs ``ep == world_size > 1``),
  after the series above, ECHO expert cloning runs outside Lightning, mirroring
  :class:`~lightning_moe.callbacks.echo.ECHOExpertCloning`: every layer's dispatcher is wrapped in
  an :class:`~lightning_moe.moe.dispatch.echo.EchoDispatcher` with N spare slots per rank; the
  router counts of ``max(warmup, 1)`` steps are summed, all-reduced over EP, and
  :func:`~lightning_moe.moe.dispatch.echo_plan.plan_clones` (tolerance 0) runs per layer; then
  ``refresh_clones()``. One ECHO step = ``refresh_clones()`` (the callback's per-optimizer-step
  copy) + forward + backward + ``reduce_clone_grads(1.0)`` (no FSDP, so the expert gradient
  scale is 1). Reported: ``echo_step_ms`` (rank 0's median), ``echo_step_ms_max_rank``,
  ``echo_clones_per_layer``, and from the last ECHO step (same inputs, so the same routing)
  ``rank_load_max_over_mean_plain`` (router counts per EP rank, as ``load_max_over_mean``) next
  to ``rank_load_max_over_mean_echo`` (rows each EP rank's experts process, clones included:
  the dispatcher's ``last_rows_per_ep_rank`` summed over the EP group, the monitor's
  definition), worst layer, with ``..._per_layer`` lists.

NCCL is kept away from NVLink multicast: ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` are forced before the
process group starts.

    torchrun --nproc_per_node=8 benchmarks/ep_scaling.py --ep 8 --out ep8.json
    torchrun --nproc_per_node=2 benchmarks/ep_scaling.py --quick --out smoke.json   # CPU, gloo
    torchrun --nproc_per_node=8 benchmarks/ep_scaling.py --ep 8 --skew 4 --echo-spare 2 --out ep8_echo.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

# Safe NCCL settings before torch.distributed can start NCCL (never NVLink multicast).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch
import torch.distributed as dist
import torch.nn as nn


import lightning_moe.moe.dispatch.comm as _comm_module
import lightning_moe.moe.dispatch.alltoall as _a2a_module
from lightning_moe import FoldedLayout, MoEConfig, MoELayer
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.echo import EchoDispatcher
from lightning_moe.moe.dispatch.echo_plan import plan_clones
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import parallelize_moe_model

__all__ = ["Shape", "main", "run"]


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The proxy's sizes: T tokens per rank, H hidden, F expert FFN, E experts, K top-k."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    layers: int


QWEN3_30B_A3B = {"hidden": 2048, "ffn": 768, "experts": 128, "top_k": 8}
QUICK = Shape(tokens=256, hidden=64, ffn=32, experts=8, top_k=2, layers=2)


class ProxyStack(nn.Module):
    """``layers`` residual MoE FFN layers: ``x = x + moe_l(x)``."""

    def __init__(self, layers: list[MoELayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_TH = x_TH + layer(x_TH)
        return x_TH


class _TimedDist:
    """Stands in for ``torch.distributed`` in the dispatcher modules; times ``all_to_all_single``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds: list[float] = []
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        return self.bracket(dist.all_to_all_single, *args, **kwargs)

    def bracket(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` between two events on the current stream (perf_counter on CPU)."""
        self.calls += 1
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def take_ms(self) -> float:
        """Sum of the bracketed intervals since the last call (ms); call after a device sync."""
        total = sum(s.elapsed_time(e) for s, e in self.events) + 1e3 * sum(self.seconds)
        self.events.clear()
        self.seconds.clear()
        return total


class _TimedExchange:
    """A library exchange (DeepEP, Hybrid-EP) whose four calls ``timer`` brackets; the rest passes through.

    The libraries' kernels run on their own stream and the current stream waits for them (no
    async finish), so the bracket on the current stream is the exposed exchange, as for NCCL.
    """

    def __init__(self, inner: Any, timer: _TimedDist) -> None:
        self.inner, self.timer = inner, timer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("dispatch", "combine", "dispatch_again", "combine_grads"):
            return lambda *args, **kwargs: self.timer.bracket(attr, *args, **kwargs)
        return attr


@contextlib.contextmanager
def _timed_all_to_all(timer: _TimedDist, stack: ProxyStack) -> Iterator[None]:
    """Time every exchange: ``dist`` in the dispatcher modules, and the library exchanges of the layers."""
    modules: tuple[ModuleType, ...] = (_comm_module, _a2a_module)
    saved = [m.dist for m in modules]  # type: ignore[attr-defined]
    libraries = [d for d in (layer.dispatcher for layer in stack.layers) if getattr(d, "exchange", None) is not None
                 and d.exchange.name in ("deepep", "hybridep")]  # fmt: skip
    try:
        for m in modules:
            m.dist = timer  # type: ignore[attr-defined]
        for d in libraries:
            d.exchange = _TimedExchange(d.exchange, timer)
        yield
    finally:
        for m, d in zip(modules, saved):
            m.dist = d  # type: ignore[attr-defined]
        for d in libraries:
            d.exchange = d.exchange.inner


def _time_steps(
    step: Callable[[], None], device: torch.device, warmup: int, iters: int, after: Callable[[], float] | None = None
) -> tuple[list[float], list[float]]:
    """Step times (ms) of ``iters`` steps after ``warmup``; ``after()`` per step (ms) if given."""
    for _ in range(warmup):
        step()
    if after is not None:
        _sync(device)
        after()
    times, extra = [], []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        if after is not None:
            _sync(device)
            extra.append(after())
    return times, extra


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_stack(
    shape: Shape,
    mesh: FoldedMesh,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    shared_ffn: int | None = None,
    overlap: bool = False,
    dispatcher: str = "alltoall",
) -> ProxyStack:
    """Same full weights on every rank (one seed), then cut to the local experts layer by layer.

    ``shared_ffn``: add a shared expert of that width; ``overlap``: run it on a side stream,
    concurrently with the token exchange (``MoEConfig.shared_expert_overlap``).
    """
    cfg = MoEConfig(
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_experts=shape.experts,
        top_k=shape.top_k,
        shared_expert_ffn_size=shared_ffn,
        shared_expert_overlap=overlap,
    )
    layers = []
    for index in range(shape.layers):
        torch.manual_seed(seed + index)
        with torch.device(device):
            layer = MoELayer(cfg, layer_name=f"layers.{index}")
        layer = layer.to(dtype=dtype)
        # expert slices + AllToAllDispatcher over the EP group (no FSDP: nothing else is timed)
        parallelize_moe_model(layer, mesh=mesh, fsdp=False, dispatcher=dispatcher)  # type: ignore[arg-type]
        layers.append(layer)
    return ProxyStack(layers)


def _skew_direction(hidden: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The shared skew direction (one seed, the same on every rank; as ``benchmarks/moe_layer.py``)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    return torch.randn(hidden, generator=g).to(device, dtype)


def skew_routers(stack: ProxyStack, skew: float) -> None:
    """Add ``skew * 0.02 * d`` to the first ``E/8`` rows of every router (no-op for ``skew <= 0``)."""
    if skew <= 0:
        return
    with torch.no_grad():
        for layer in stack.layers:
            weight = layer.router.weight  # type: ignore[union-attr]
            hot = max(weight.shape[0] // 8, 1)
            weight[:hot] += skew * 0.02 * _skew_direction(weight.shape[1], weight.device, weight.dtype)


def _max_over_mean(per_rank: torch.Tensor) -> float:
    return float(per_rank.max() / per_rank.mean())  # SYNC: reporting only


def _load_per_layer(stack: ProxyStack, mesh: FoldedMesh, ep: int) -> list[float]:
    """max/mean over EP ranks of the rows each rank's experts receive, one value per layer."""
    out = []
    for layer in stack.layers:
        counts_E = layer.last_tokens_per_expert.detach().to(torch.float64).clone()  # type: ignore[union-attr]
        if ep > 1:
            dist.all_reduce(counts_E, group=mesh.group("ep"))
        per_rank = counts_E.view(ep, -1).sum(1)
        out.append(_max_over_mean(per_rank))
    return out


def _echo_rows_per_layer(echos: list[EchoDispatcher], mesh: FoldedMesh, device: torch.device) -> list[float]:
    """max/mean over EP ranks of the rows each rank's experts process (clones included), per layer."""
    out = []
    for echo in echos:
        assert echo.last_rows_per_ep_rank is not None
        rows_P = echo.last_rows_per_ep_rank.to(device, torch.float64)  # rows this rank sent to each EP rank
        dist.all_reduce(rows_P, group=mesh.group("ep"))
        out.append(_max_over_mean(rows_P))
    return out


def run_echo(
    stack: ProxyStack,
    step: Callable[[], None],
    mesh: FoldedMesh,
    device: torch.device,
    spare: int,
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """ECHO outside Lightning (the callback's stages 1-4): wrap, count, plan, refresh, time."""
    echos = []
    for layer in stack.layers:
        base = layer.dispatcher  # type: ignore[union-attr]
        echo = EchoDispatcher(base, layer.experts, spare_slots=spare)  # type: ignore[union-attr]
        layer.dispatcher = echo  # type: ignore[union-attr]
        echos.append(echo)
    # stage 2: routed counts of a few steps (no clones yet: routing is the same as without ECHO)
    E = stack.layers[0].config.num_experts  # type: ignore[union-attr]
    counts_LE = torch.zeros(len(echos), E, dtype=torch.float64, device=device)
    for _ in range(max(warmup, 1)):
        step()
        for i, layer in enumerate(stack.layers):
            counts_LE[i] += layer.last_tokens_per_expert.to(counts_LE)  # type: ignore[union-attr]
        for echo in echos:
            echo.reduce_clone_grads(1.0)  # no plan yet: only clears the clone gradients
    # stage 3: one all-reduce over EP for every layer, plan per layer, copy the clone weights
    dist.all_reduce(counts_LE, group=mesh.group("ep"))
    for i, echo in enumerate(echos):
        echo.plan = plan_clones(counts_LE[i], echo.ep_size, echo.spare_slots, 0.0)
        echo.refresh_clones()

    def echo_step() -> None:
        for echo in echos:
            echo.refresh_clones()  # the callback does this after every optimizer step
        step()
        for echo in echos:
            echo.reduce_clone_grads(1.0)  # stage 4 (fsdp=False: expert gradient scale 1)

    echo_ms, _ = _time_steps(echo_step, device, 1, iters)
    rows_echo = _echo_rows_per_layer(echos, mesh, device)
    routed_plain = _load_per_layer(stack, mesh, echos[0].ep_size)  # same step's router counts
    clones = [0 if echo.plan is None else echo.plan.num_clones for echo in echos]
    for layer, echo in zip(stack.layers, echos):
        layer.dispatcher = echo.base  # type: ignore[union-attr]  # stage 5: restore
    return {
        "echo_step_ms_all": echo_ms,
        "echo_clones_per_layer": clones,
        "rank_load_max_over_mean_plain": max(routed_plain),
        "rank_load_max_over_mean_plain_per_layer": routed_plain,
        "rank_load_max_over_mean_echo": max(rows_echo),
        "rank_load_max_over_mean_echo_per_layer": rows_echo,
    }


def _profile_steps(step: Callable[[], None], device: torch.device, rank: int, steps: int = 3) -> dict[str, Any]:
    """Rank 0's GPU time per kernel over ``steps`` steps (every rank steps: the collectives need all)."""
    from profiling import device_kernels
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if rank == 0 else contextlib.nullcontext()
    with prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if rank != 0:
        return {}
    kernels = device_kernels(prof)
    return {
        "wall_ms_per_step": round(wall_ms, 3),
        "top_kernels_ms_per_step": [[round(k["total_ms"] / steps, 3), k["count"] // steps, k["name"][:90]] for k in kernels[:25]],
    }


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark on this rank; rank 0 returns the report, the others None."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        shape = QUICK
    else:
        shape = Shape(tokens=args.tokens, layers=args.layers, **QWEN3_30B_A3B)
    ep = world if args.ep is None else args.ep
    if world % ep or shape.experts % ep:
        raise ValueError(
            f"ep_scaling: ep={ep} must divide world_size={world} and num_experts={shape.experts}; "
            f"choose ep from {[d for d in range(1, world + 1) if world % d == 0 and shape.experts % d == 0]}."
        )
    if args.echo_spare < 0:
        raise ValueError(f"ep_scaling: --echo-spare={args.echo_spare} must be >= 0 (0 turns ECHO off).")
    if args.echo_spare > 0 and not (ep == world and ep > 1):
        raise ValueError(
            f"ep_scaling: --echo-spare needs ep == world_size > 1 (ECHO needs edp=1); got ep={ep}, world_size={world}."
        )
    if args.overlap_shared and args.shared_expert_ffn is None:
        raise ValueError("ep_scaling: --overlap-shared needs --shared-expert-ffn N (there is no shared expert to overlap).")
    mesh = FoldedMesh.build(FoldedLayout(world_size=world, ep=ep), device_type=device.type)
    stack = build_stack(
        shape, mesh, device, dtype, args.seed, args.shared_expert_ffn, args.overlap_shared, args.dispatcher
    )
    skew_routers(stack, args.skew)

    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + rank)
    x_TH = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
    if args.skew > 0:
        x_TH = x_TH + _skew_direction(shape.hidden, device, dtype)
    grad_TH = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype, generator=gen)

    def step() -> None:
        stack.zero_grad(set_to_none=True)
        stack(x_TH).backward(grad_TH)

    warmup, iters = args.warmup, max(args.iters, 8)
    plain_ms, _ = _time_steps(step, device, warmup, iters)
    timer = _TimedDist(device)
    with _timed_all_to_all(timer, stack):
        timed_ms, a2a_ms = _time_steps(step, device, 1, iters, after=timer.take_ms)
    a2a_calls = timer.calls / (iters + 1)  # the one warm-up step of the timed series included
    load = _load_per_layer(stack, mesh, ep)
    echo = run_echo(stack, step, mesh, device, args.echo_spare, warmup, iters) if args.echo_spare > 0 else None
    profile = _profile_steps(step, device, rank) if args.profile and device.type == "cuda" else None

    step_med = statistics.median(plain_ms)
    echo_med = statistics.median(echo["echo_step_ms_all"]) if echo is not None else 0.0
    medians = torch.tensor(
        [step_med, statistics.median(timed_ms), statistics.median(a2a_ms), echo_med], dtype=torch.float64, device=device
    )
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    gathered = [g.cpu() for g in gathered]  # SYNC: reporting only
    if rank != 0:
        return None
    flop = 18 * shape.tokens * shape.top_k * shape.hidden * shape.ffn * shape.layers
    a2a_med, timed_med = statistics.median(a2a_ms), statistics.median(timed_ms)
    echo_report: dict[str, Any] = {}
    if echo is not None:
        echo_report = {
            "echo_step_ms": echo_med,
            "echo_step_ms_max_rank": max(float(g[3]) for g in gathered),
            **echo,
        }
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "world_size": world,
        "ep": ep,
        "edp": world // ep,
        "dtype": str(dtype).removeprefix("torch."),
        "quick": bool(args.quick),
        "shape": asdict(shape),
        "warmup": warmup,
        "iters": iters,
        "step_ms": step_med,
        "step_ms_all": plain_ms,
        "step_ms_max_rank": max(float(g[0]) for g in gathered),
        "tflops_per_gpu": flop / (step_med * 1e-3) / 1e12,
        "expert_gemm_flop_per_rank": flop,
        "step_ms_timed": timed_med,
        "a2a_ms": a2a_med,
        "a2a_share": a2a_med / timed_med if timed_med > 0 else 0.0,
        "a2a_share_max_rank": max(float(g[2] / g[1]) if g[1] > 0 else 0.0 for g in gathered),
        "a2a_calls_per_step": a2a_calls,
        "a2a_method": "CUDA events (perf_counter on CPU) around dist.all_to_all_single and the DeepEP / Hybrid-EP "
        "exchange calls, second series of steps",
        "load_max_over_mean": max(load),
        "load_max_over_mean_per_layer": load,
        "skew": args.skew,
        "echo_spare": args.echo_spare,
        "shared_expert_ffn": args.shared_expert_ffn,  # its FLOPs are not in the TFLOP/s figures
        "overlap_shared": args.overlap_shared,
        "dispatcher": args.dispatcher,
        **echo_report,
        **({"profile": profile} if profile is not None else {}),
        "command": " ".join([f"torchrun --nproc_per_node={world}", *sys.argv]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed steps (at least 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="router skew: a few experts take most tokens (0: off)",
    )
    p.add_argument(
        "--echo-spare",
        type=int,
        default=0,
        help="ECHO spare slots per EP rank and layer (0: off; needs ep == world)",
    )
    p.add_argument(
        "--shared-expert-ffn",
        type=int,
        default=None,
        help="add a shared expert of this FFN width to every layer (default: none)",
    )
    p.add_argument(
        "--overlap-shared",
        action="store_true",
        help="run the shared expert on a side stream, overlapping the exchange (needs --shared-expert-ffn)",
    )
    p.add_argument(
        "--dispatcher",
        default="alltoall",
        choices=["alltoall", "alltoall_dedup", "allgather", "deepep", "hybridep"],
        help="token exchange (the exposed-exchange share brackets all_to_all_single and the library exchanges)",
    )
    p.add_argument("--profile", action="store_true", help="add rank 0's per-kernel GPU time over 3 steps (CUDA)")
    p.add_argument("--quick", action="store_true", help=f"tiny shapes, CPU smoke test: {QUICK}")
    p.add_argument("--out", type=Path, default=None, help="write rank 0's JSON report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("ep_scaling: start under torchrun, e.g. torchrun --nproc_per_node=8 benchmarks/ep_scaling.py")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        report = run(args)
        if report is not None:
            text = json.dumps(report, indent=2)
            print(text, flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
