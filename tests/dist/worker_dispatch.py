"""Worker: AllToAll, AllGather and flex (DeepEP, Hybrid-EP stand-ins) dispatchers against LocalDispatcher.

Run by ``test_dist_dispatch.py`` through ``worker_suite.py`` under torchrun (gloo). Every rank
builds the same global inputs from one seed, routes its own tokens, and checks outputs, input
gradients, routing-weight gradients and its local experts' weight gradients against a
single-process run of the same tokens.
"""

from __future__ import annotations

import sys

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

T, H, F, E, K = 12, 8, 6, 8, 2


def routed_inputs(seed: int, skew: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    if skew:  # experts 0, 3 and 5 get no token; uneven splits across ranks
        choices = torch.tensor([1, 2, 4, 6, 7, 7, 7])
        ids = choices[torch.randint(0, len(choices), (T, K), generator=g)]
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
        ids[ids == 0] = 1
        ids[ids == 3] = 4
        ids[ids == 5] = 6
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], -1, ids[:, 1])  # a dropped slot
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=torch.float64) * (ids >= 0)
    c = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, ids, w, c


def run(dispatcher, experts, x, ids, w, c, weighted: bool):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    d, handle = dispatcher.dispatch(x, ids, w, None)
    rows = int(d.tokens_per_expert_e.sum())  # every dispatched row belongs to a local expert: none past the last
    if d.x_RH.shape[0] != rows or d.weights_R.shape[0] != rows:
        raise AssertionError(f"{dispatcher!r}: {d.x_RH.shape[0]} rows, {d.weights_R.shape[0]} weights, {rows} counted")
    y_R = experts(d.x_RH, d.tokens_per_expert_e, None if weighted else d.weights_R)
    y = dispatcher.combine(y_R, handle, weighted=weighted)
    (y * c).sum().backward()
    return y.detach(), x.grad, w.grad


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-10):
        raise AssertionError(f"{name}: max abs diff {(got - want).abs().max().item():.3e}")


def main(kind: str, tp: int, ep: int, etp: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, tp=tp, ep=ep, etp=etp)
    mesh = FoldedMesh.build(layout, "cpu")
    coords = layout.coords(rank)
    data_rank, dp = coords["dp"], layout.dp  # tensor-parallel replicas hold the same tokens
    torch.manual_seed(0)
    full = GroupedExperts(E, H, F, backend="loop").double()
    for skew in (False, True):
        for weighted in (False, True):
            inputs = [routed_inputs(100 * int(skew) + d, skew) for d in range(dp)]
            # reference: every data shard through all experts, one process
            ref = GroupedExperts(E, H, F, backend="loop").double()
            ref.load_state_dict(full.state_dict())
            local = LocalDispatcher(E)
            outs = [run(local, ref, *inp, weighted=weighted) for inp in inputs]
            # distributed: this rank's shard through its local experts
            part = GroupedExperts(E // ep, H, F // etp, backend="loop").double()
            w13, w2 = shard_expert_weights(
                full.w13.detach(), full.w2.detach(), ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
            )
            with torch.no_grad():
                part.w13.copy_(w13)
                part.w2.copy_(w2)
            groups = dict(ep_group=mesh.group("ep"), etp_group=mesh.group("etp"))
            ep_group = mesh.group("ep")
            if kind == "dedup":  # the flex dispatcher over torch.distributed, one row per (token, rank)
                disp = FlexDispatcher(E, **groups, exchange=AllToAllTokenExchange(ep_group))
            elif kind == "deepep":  # the flex dispatcher over gloo stand-ins for the libraries
                disp = FlexDispatcher(E, **groups, exchange=DeepEPExchange(FakeDeepEPBuffer(ep_group)))
            elif kind == "hybridep":
                fake = lambda h, t: FakeHybridEPBuffer(ep_group, E, h, t)  # noqa: E731
                disp = FlexDispatcher(E, **groups, exchange=HybridEPExchange(ep_group, E, make_buffer=fake))
            else:
                disp = AllToAllDispatcher(E, **groups) if kind == "alltoall" else AllGatherDispatcher(E, **groups)
            y, gx, gw = run(disp, part, *inputs[data_rank], weighted=weighted)
            tag = f"{kind} skew={skew} weighted={weighted} rank={rank}"
            check(f"{tag} output", y, outs[data_rank][0])
            check(f"{tag} grad x", gx, outs[data_rank][1])
            check(f"{tag} grad weights", gw, outs[data_rank][2])
            g13, g2 = shard_expert_weights(
                ref.w13.grad, ref.w2.grad, ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
            )
            # each expert shard saw every data shard once per tensor-parallel replica that feeds it
            dup = tp // etp
            check(f"{tag} grad w13", part.w13.grad, dup * g13)
            check(f"{tag} grad w2", part.w2.grad, dup * g2)
    dist.barrier()
    if rank == 0:
        print(f"OK {kind} tp={tp} ep={ep} etp={etp}", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:  # kind:tp:ep:etp
        kind, tp, ep, etp = spec.split(":")
        main(kind, int(tp), int(ep), int(etp))
    dist.destroy_process_group()
