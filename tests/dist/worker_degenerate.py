"""Worker: every expert-parallel dispatcher on random skewed routings, against one process.

Run by ``test_dist_degenerate.py`` under torchrun (gloo). Arguments: specs
``kind:tp:ep:etp:steps``. At each step every rank builds the same global inputs from one seed (all data
shards), so it can compute the single-process result of every shard with ``LocalDispatcher`` and
all experts; it then routes its own shard through the dispatcher and its local experts and checks
the output, the input gradient, the routing-weight gradient and its experts' weight gradients.

The routings are chosen to be degenerate: Zipf-distributed expert popularity, every token on one
expert, no token for one EP rank's experts, every slot dropped, and empty micro-batches (T = 0) on
some data shards while the others have tokens.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from _fake_deep_ep import FakeDeepEPBuffer, FakeHybridEPBuffer

from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.exchange_alltoall_dedup import AllToAllTokenExchange
from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange
from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange
from lightning_moe.moe.dispatch.flex import FlexDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import shard_expert_weights

H, F, E, K, T_MAX = 4, 4, 8, 2, 6
MODES = ("zipf", "one_expert", "rank_starved", "all_dropped", "uniform")


def skewed_routing(seed: int, mode: str, ep: int) -> tuple[torch.Tensor, ...]:
    """``x``, ``ids``, ``w``, ``c`` (upstream gradient) of one data shard; T may be 0."""
    g = torch.Generator().manual_seed(seed)
    T = 0 if torch.rand((), generator=g) < 0.2 else int(torch.randint(1, T_MAX + 1, (), generator=g))
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    c = torch.randn(T, H, generator=g, dtype=torch.float64)
    if mode == "zipf":  # expert popularity ~ 1/rank^2 over a random expert order
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 2
        logits = torch.log(pop[torch.randperm(E, generator=g)]) + 0.3 * torch.randn(T, E, generator=g, dtype=torch.float64)
    elif mode == "one_expert":  # one-hot router logits: every token's first slot on expert j
        logits = torch.zeros(T, E, dtype=torch.float64)
        logits[:, int(torch.randint(0, E, (), generator=g))] = 10.0
        logits += 1e-3 * torch.randn(T, E, generator=g, dtype=torch.float64)
    elif mode == "rank_starved":  # the experts of one EP rank get no token from anyone
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        e = E // ep
        starved = (seed // 7) % ep
        logits[:, starved * e : (starved + 1) * e] = -1e9
    else:
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    drop = torch.rand(T, K, generator=g) < (1.0 if mode == "all_dropped" else 0.1)
    ids = torch.where(drop, -1, ids)
    w = w * (ids >= 0)
    return x, ids, w, c


def run(dispatcher, experts, x, ids, w, c, weighted: bool):  # noqa: ANN001, ANN201
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    d, handle = dispatcher.dispatch(x, ids, w, None)
    y_R = experts(d.x_RH, d.tokens_per_expert_e, None if weighted else d.weights_R)
    y = dispatcher.combine(y_R, handle, weighted=weighted)
    (y * c).sum().backward()
    return y.detach(), x.grad, w.grad


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):  # the SwiGLU computes in fp32 (its spec)
        raise AssertionError(f"{name}: max abs diff {(got - want).abs().max().item():.3e}")


def make_dispatcher(kind: str, mesh: FoldedMesh):  # noqa: ANN201
    ep_group = mesh.group("ep")
    groups = dict(ep_group=ep_group, etp_group=mesh.group("etp"))
    if kind == "dedup":
        return FlexDispatcher(E, **groups, exchange=AllToAllTokenExchange(ep_group))
    if kind == "deepep":
        return FlexDispatcher(E, **groups, exchange=DeepEPExchange(FakeDeepEPBuffer(ep_group)))
    if kind == "hybridep":
        fake = lambda h, t: FakeHybridEPBuffer(ep_group, E, h, t)  # noqa: E731
        return FlexDispatcher(E, **groups, exchange=HybridEPExchange(ep_group, E, make_buffer=fake))
    if kind == "alltoall":
        return AllToAllDispatcher(E, **groups)
    if kind == "allgather":
        return AllGatherDispatcher(E, **groups)
    raise ValueError(f"worker_degenerate: kind={kind!r} is unknown; use dedup, deepep, hybridep, alltoall or allgather.")


def main(kind: str, tp: int, ep: int, etp: int, steps: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, tp=tp, ep=ep, etp=etp)
    mesh = FoldedMesh.build(layout, "cpu")
    coords = layout.coords(rank)
    data_rank, dp = coords["dp"], layout.dp  # tensor-parallel replicas hold the same tokens
    disp = make_dispatcher(kind, mesh)
    local = LocalDispatcher(E)
    start = time.perf_counter()
    seen = {"empty_rank": 0, "empty_shard": 0}
    for step in range(steps):
        torch.manual_seed(1000 + step)
        full = GroupedExperts(E, H, F, backend="loop").double()
        mode = MODES[step % len(MODES)]
        weighted = bool(step % 2)
        inputs = [skewed_routing(10_000 * step + d, mode, ep) for d in range(dp)]
        ref = GroupedExperts(E, H, F, backend="loop").double()
        ref.load_state_dict(full.state_dict())
        # one run of all shards' tokens: per-token results and summed expert gradients alike
        y_all, gx_all, gw_all = run(local, ref, *(torch.cat(parts) for parts in zip(*inputs)), weighted=weighted)
        lo = sum(inp[0].shape[0] for inp in inputs[:data_rank])
        mine = slice(lo, lo + inputs[data_rank][0].shape[0])
        outs = {data_rank: (y_all[mine], gx_all[mine], gw_all[mine])}
        part = GroupedExperts(E // ep, H, F // etp, backend="loop").double()
        w13, w2 = shard_expert_weights(
            full.w13.detach(), full.w2.detach(), ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
        )
        with torch.no_grad():
            part.w13.copy_(w13)
            part.w2.copy_(w2)
        y, gx, gw = run(disp, part, *inputs[data_rank], weighted=weighted)
        tag = f"{kind} tp={tp} ep={ep} etp={etp} step={step} mode={mode} weighted={weighted} rank={rank}"
        check(f"{tag} output", y, outs[data_rank][0])
        check(f"{tag} grad x", gx, outs[data_rank][1])
        check(f"{tag} grad weights", gw, outs[data_rank][2])
        g13, g2 = shard_expert_weights(
            ref.w13.grad, ref.w2.grad, ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
        )
        dup = tp // etp  # each expert shard saw every data shard once per tensor-parallel replica
        got13 = torch.zeros_like(g13) if part.w13.grad is None else part.w13.grad
        got2 = torch.zeros_like(g2) if part.w2.grad is None else part.w2.grad
        check(f"{tag} grad w13", got13, dup * g13)
        check(f"{tag} grad w2", got2, dup * g2)
        seen["empty_shard"] += int(inputs[data_rank][0].shape[0] == 0)
        seen["empty_rank"] += int(g13.abs().sum() == 0)  # this rank's experts got no row from anyone
    dist.barrier()
    if rank == 0:
        took = time.perf_counter() - start
        print(
            f"OK {kind} tp={tp} ep={ep} etp={etp} steps={steps} empty_shard={seen['empty_shard']} "
            f"empty_rank={seen['empty_rank']} {took:.1f}s",
            flush=True,
        )


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:  # kind:tp:ep:etp:steps
        kind, tp, ep, etp, steps = spec.split(":")
        main(kind, int(tp), int(ep), int(etp), int(steps))
    dist.destroy_process_group()
