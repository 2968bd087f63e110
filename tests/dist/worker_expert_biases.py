"""Worker: experts with biases and a clamped SwiGLU under EP and ETP, against one process.

Run by ``test_dist_expert_biases.py`` under torchrun (gloo). Arguments: specs
``kind:tp:ep:etp:steps``. The routings, dispatchers and checks are ``worker_degenerate.py``'s
(skewed and degenerate: one busy expert, starved EP ranks, dropped slots, empty shards); the
experts here have ``mlp_bias`` and gpt-oss's activation, their biases laid out as
``parallel.parallelize._shard_experts`` does (``shard_expert_biases``; the down bias split over
its columns under ETP, each rank adding its own). Checked each step: output, input and
routing-weight gradients, and every weight and bias gradient of this rank's shard.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from worker_degenerate import E, F, H, MODES, check, make_dispatcher, run, skewed_routing

from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.swiglu import SwiGLUOptions
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import shard_expert_biases, shard_expert_weights

SWIGLU = SwiGLUOptions(alpha=1.702, limit=0.5, up_offset=1.0)


def experts(num: int, ffn: int, seed: int | None = None) -> GroupedExperts:
    ex = GroupedExperts(num, H, ffn, backend="loop", mlp_bias=True, swiglu=SWIGLU).double()
    if seed is not None:
        with torch.no_grad():
            for p in ex.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return ex


def main(kind: str, tp: int, ep: int, etp: int, steps: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, tp=tp, ep=ep, etp=etp)
    mesh = FoldedMesh.build(layout, "cpu")
    coords = layout.coords(rank)
    data_rank, dp = coords["dp"], layout.dp
    disp = make_dispatcher(kind, mesh)
    shard = dict(ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp)
    start = time.perf_counter()
    for step in range(steps):
        mode = MODES[step % len(MODES)]
        weighted = bool(step % 2)
        inputs = [skewed_routing(10_000 * step + d, mode, ep) for d in range(dp)]
        ref = experts(E, F, seed=step)
        y_all, gx_all, gw_all = run(LocalDispatcher(E), ref, *(torch.cat(p) for p in zip(*inputs)), weighted=weighted)
        lo = sum(inp[0].shape[0] for inp in inputs[:data_rank])
        mine = slice(lo, lo + inputs[data_rank][0].shape[0])
        part = experts(E // ep, F // etp)
        w13, w2 = shard_expert_weights(ref.w13.detach(), ref.w2.detach(), **shard)
        b13, b2 = shard_expert_biases(ref.b13.detach(), ref.b2.detach(), **shard)
        part.b2 = torch.nn.Parameter(b2)
        part.down_bias_offset = coords["etp"] * (H // etp)
        with torch.no_grad():
            for name, value in (("w13", w13), ("w2", w2), ("b13", b13)):
                getattr(part, name).copy_(value)
        y, gx, gw = run(disp, part, *inputs[data_rank], weighted=weighted)
        tag = f"{kind} tp={tp} ep={ep} etp={etp} step={step} mode={mode} weighted={weighted} rank={rank}"
        check(f"{tag} output", y, y_all[mine])
        check(f"{tag} grad x", gx, gx_all[mine])
        check(f"{tag} grad weights", gw, gw_all[mine])
        dup = tp // etp  # each expert shard saw every data shard once per tensor-parallel replica
        want = (*shard_expert_weights(ref.w13.grad, ref.w2.grad, **shard),
                *shard_expert_biases(ref.b13.grad, ref.b2.grad, **shard))  # fmt: skip
        for name, grad in zip(("w13", "w2", "b13", "b2"), want):
            got = getattr(part, name).grad
            check(f"{tag} grad {name}", torch.zeros_like(grad) if got is None else got, dup * grad)
    dist.barrier()
    if rank == 0:
        print(f"OK {kind} tp={tp} ep={ep} etp={etp} steps={steps} {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:  # kind:tp:ep:etp:steps
        kind, tp, ep, etp, steps = spec.split(":")
        main(kind, int(tp), int(ep), int(etp), int(steps))
    dist.destroy_process_group()
