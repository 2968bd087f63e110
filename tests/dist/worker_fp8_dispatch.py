"""Worker: FP8 token dispatch (all-to-all, flex over alltoall_dedup and the DeepEP stand-in) against the
local FP8 dispatch of one process, and the bytes its row exchange moves.

Run by ``test_dist_fp8_dispatch.py`` under torchrun (gloo, 4 ranks): ``worker_fp8_dispatch.py
kind:tp:ep:etp ... sp:kind ... layer:kind ... bytes:kind ...``. Every rank builds the same global
inputs from one seed, dispatches its own tokens with ``fp8_rows`` set, runs its local experts on
the FP8 rows (``x_fp8``; the placeholder ``x_RH`` carries the gradient) and checks the output and the gradients of x, the routing weights,
w13 and w2 against a single-process run of the same tokens through ``LocalDispatcher`` with the
same ``fp8_rows`` and all experts (the same quantized rows reach the same experts, so only
summation order differs). The skewed routing leaves experts 0, 3 and 5 without a token, drops a
slot, and gives data shard 1 no tokens at all (it sends nothing).

Two kinds of experts take the rows: ``plain`` (the dequantized rows through the activation-dtype
experts: any recipe and format, fp32 and fp64) and ``fp8`` (the FP8 experts, ``x_fp8=`` straight
into their first GEMM, emulated). With ETP the FP8 experts quantize sharded weights, which one
process with whole weights does not; their reference is then the same dispatcher moving
activation-dtype rows that the experts quantize themselves (``fp8_rows=None``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _fake_deep_ep import FakeDeepEPBuffer

from lightning_moe.config import Fp8Config
from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.exchange_alltoall_dedup import AllToAllTokenExchange
from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange
from lightning_moe.moe.dispatch.flex import FlexDispatcher
from lightning_moe.moe.dispatch.fp8_rows import row_bytes
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.ops.fp8.quantize import quantize
from lightning_moe.parallel.parallelize import shard_expert_weights

T, F, E, K = 12, 8, 8, 2
# of the largest entry: the same FP8 rows reach the same experts, so results differ only in the
# order of the sums, a few fp32 ulps of the largest term (the SwiGLU runs in fp32 for fp64 rows too,
# and ETP splits its sums over F; the BLAS's blocking, and so the order, differs between CPUs: 3e-6
# of the largest entry was seen for an ETP2 weight gradient); a wrong row or scale would be off by
# the FP8 error, ~1e-2
TOL = 1e-5


def routed_inputs(seed: int, skew: bool, H: int, empty: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T).unsqueeze(1)  # per-row scales differ widely
    if skew:  # experts 0, 3 and 5 get no token; uneven splits across ranks; a dropped slot
        choices = torch.tensor([1, 2, 4, 6, 7, 7, 7])
        ids = choices[torch.randint(0, len(choices), (T, K), generator=g)]
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], -1, ids[:, 1])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) * (ids >= 0)
    c = torch.randn(T, H, generator=g)
    if empty:  # this data shard has no tokens: it sends nothing and receives its share of nothing
        x, ids, w, c = x[:0], ids[:0], w[:0], c[:0]
    return x, ids, w, c


def experts_on_rows(experts: GroupedExperts, d, weighted: bool, fp8_rows: bool) -> torch.Tensor:
    """The experts on the dispatched rows: FP8 rows straight into the FP8 experts (``x_fp8``), or
    dequantized for the plain experts, plus the placeholder (zeros) that carries the gradient."""
    w_R = None if weighted else d.weights_R
    if not fp8_rows:
        if d.x_fp8 is not None:
            raise AssertionError("the dispatcher returned FP8 rows although fp8_rows was not set")
        return experts(d.x_RH, d.tokens_per_expert_e, w_R)
    if d.x_fp8 is None:
        raise AssertionError("the dispatcher returned no FP8 rows although fp8_rows was set")
    if d.x_RH.stride() != (0, 0) or d.x_RH.shape != d.x_fp8.data.shape:
        raise AssertionError(f"placeholder {tuple(d.x_RH.shape)} strides {d.x_RH.stride()} for {tuple(d.x_fp8.shape)} rows")
    if experts.fp8 is not None:
        return experts(d.x_RH, d.tokens_per_expert_e, w_R, x_fp8=d.x_fp8)
    return experts(d.x_fp8.dequantize(d.x_RH.dtype) + d.x_RH, d.tokens_per_expert_e, w_R)


def run(dispatcher, experts, x, ids, w, c, weighted: bool, straight_through: tuple | None = None):
    """One dispatch -> experts -> combine and backward; ``straight_through``: feed the tokens as FP8
    would round them (that recipe), with the identity gradient, to a dispatcher moving activation-dtype rows."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    x_in = x
    if straight_through is not None:
        tile = (1, 128) if straight_through[0] == "blockwise" else None
        q = quantize(x.detach(), straight_through[0], straight_through[1], tile=tile, pow2_scales=straight_through[2])
        x_in = x + (q.dequantize(x.dtype) - x).detach()
    d, handle = dispatcher.dispatch(x_in, ids, w, None)
    rows = int(d.tokens_per_expert_e.sum())
    if d.x_RH.shape[0] != rows or d.weights_R.shape[0] != rows:
        raise AssertionError(f"{dispatcher!r}: {d.x_RH.shape[0]} rows, {d.weights_R.shape[0]} weights, {rows} counted")
    y_R = experts_on_rows(experts, d, weighted, dispatcher.fp8_rows is not None)
    y = dispatcher.combine(y_R, handle, weighted=weighted)
    (y * c).sum().backward()
    return y.detach(), x.grad, w.grad


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}")
    if got.numel() == 0:
        return
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not diff <= TOL * scale:
        raise AssertionError(f"{name}: max abs diff {diff:.3e} > {TOL:g} of the largest entry {scale:.3e}")


def make_dispatcher(kind: str, groups: dict, ep_group, sp: bool = False):
    if kind == "alltoall":
        return AllToAllDispatcher(E, **groups, etp_sequence_parallel=sp)
    if kind == "dedup":
        return FlexDispatcher(E, **groups, exchange=AllToAllTokenExchange(ep_group), etp_sequence_parallel=sp)
    if kind == "deepep":
        return FlexDispatcher(E, **groups, exchange=DeepEPExchange(FakeDeepEPBuffer(ep_group)))
    raise ValueError(f"worker_fp8_dispatch: kind={kind!r} is unknown; use alltoall, dedup or deepep.")


def main(kind: str, tp: int, ep: int, etp: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, tp=tp, ep=ep, etp=etp)
    mesh = FoldedMesh.build(layout, "cpu")
    coords = layout.coords(rank)
    data_rank, dp = coords["dp"], layout.dp  # tensor-parallel replicas hold the same tokens
    groups = dict(ep_group=mesh.group("ep"), etp_group=mesh.group("etp"))
    # DeepEP moves (e4m3 data, one scale per 128 columns) pairs only: blockwise, H a multiple of 128
    if kind == "deepep":
        cases = [
            (("blockwise", "e4m3", True), 256, torch.float64, "plain"),
            (("blockwise", "e4m3", False), 256, torch.float32, "fp8"),
        ]
    else:
        cases = [
            (("rowwise", "e4m3", False), 200, torch.float32, "plain"),
            (("blockwise", "e5m2", True), 200, torch.float64, "plain"),
            (("blockwise", "e4m3", False), 200, torch.float32, "fp8"),
            (("rowwise", "e4m3", True), 200, torch.float32, "fp8"),
        ]
    for spec, H, dtype, mode in cases:
        fp8 = Fp8Config(recipe=spec[0], backend="emulate", pow2_scales=spec[2]) if mode == "fp8" else None
        torch.manual_seed(0)
        full = GroupedExperts(E, H, F, backend="loop").to(dtype)
        for skew in (False, True):
            weighted = skew  # both ways of applying the routing weight, one per routing
            inputs = [routed_inputs(100 * int(skew) + s, skew, H, empty=skew and s == 1) for s in range(dp)]
            inputs = [tuple(t.to(dtype) if t.is_floating_point() else t for t in inp) for inp in inputs]
            w13, w2 = shard_expert_weights(
                full.w13.detach(), full.w2.detach(), ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
            )
            part = GroupedExperts(E // ep, H, F // etp, backend="loop", fp8=fp8).to(dtype)
            with torch.no_grad():
                part.w13.copy_(w13)
                part.w2.copy_(w2)
            shards = [layout.coords(m)["dp"] for m in dist.get_process_group_ranks(mesh.group("ep"))]
            if fp8 is not None and etp > 1:  # sharded FP8 weights: the experts quantize the rows they receive
                same = GroupedExperts(E // ep, H, F // etp, backend="loop", fp8=fp8).to(dtype)
                same.load_state_dict(part.state_dict())
                want = run(make_dispatcher(kind, groups, mesh.group("ep")), same, *inputs[data_rank], weighted=weighted)
                want13, want2 = same.w13.grad, same.w2.grad
            elif fp8 is not None:
                # FP8 weight gradients quantize each expert's rows together (units along the rows), so the
                # reference holds the EP group's tokens in one batch, in the order the exchange stacks them
                ref = GroupedExperts(E, H, F, backend="loop", fp8=fp8).to(dtype)
                ref.load_state_dict(full.state_dict())
                local = LocalDispatcher(E)
                local.fp8_rows = spec
                batch = [torch.cat([inputs[d][i] for d in shards]) for i in range(4)]
                y_all, gx_all, gw_all = run(local, ref, *batch, weighted=weighted)
                start = sum(inputs[d][0].shape[0] for d in shards[: shards.index(data_rank)])
                mine = slice(start, start + inputs[data_rank][0].shape[0])
                want = (y_all[mine], gx_all[mine], gw_all[mine])
                want13, want2 = shard_expert_weights(
                    ref.w13.grad, ref.w2.grad, ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
                )
            else:  # one process: each data shard through all experts
                outs, grads = [], []
                for inp in inputs:
                    ref = GroupedExperts(E, H, F, backend="loop", fp8=fp8).to(dtype)
                    ref.load_state_dict(full.state_dict())
                    local = LocalDispatcher(E)
                    local.fp8_rows = spec
                    outs.append(run(local, ref, *inp, weighted=weighted))
                    grads.append(shard_expert_weights(
                        ref.w13.grad, ref.w2.grad, ep_rank=coords["ep"], ep=ep, etp_rank=coords["etp"], etp=etp
                    ))  # fmt: skip
                want = outs[data_rank]
                # this expert shard saw the tokens of every rank of its EP group
                want13, want2 = sum(grads[d][0] for d in shards), sum(grads[d][1] for d in shards)
            disp = make_dispatcher(kind, groups, mesh.group("ep"))
            disp.fp8_rows = spec
            y, gx, gw = run(disp, part, *inputs[data_rank], weighted=weighted)
            tag = f"{kind} tp={tp} ep={ep} etp={etp} {spec} {dtype} {mode} H={H} skew={skew} rank={rank}"
            check(f"{tag} output", y, want[0])
            check(f"{tag} grad x", gx, want[1])
            check(f"{tag} grad weights", gw, want[2])
            check(f"{tag} grad w13", part.w13.grad, want13)
            check(f"{tag} grad w2", part.w2.grad, want2)
            if kind == "deepep" and disp.exchange.buffer.calls["fp8_dispatch"] != 1:
                raise AssertionError(f"{tag}: the DeepEP stand-in got no (data, scales) pair")
    dist.barrier()
    if rank == 0:
        print(f"OK {kind} tp={tp} ep={ep} etp={etp}", flush=True)


def sequence_parallel_etp(kind: str) -> None:
    """ETP2 x EP2 with the ETP ranks holding different tokens (sequence parallel): the FP8 rows are
    all-gathered over ETP; the reference moves the same rounded tokens in the activation dtype."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, tp=2, ep=2, etp=2)
    mesh = FoldedMesh.build(layout, "cpu")
    coords = layout.coords(rank)
    groups = dict(ep_group=mesh.group("ep"), etp_group=mesh.group("etp"))
    H = 200
    for spec in (("blockwise", "e4m3", False), ("rowwise", "e5m2", True)):
        torch.manual_seed(0)
        full = GroupedExperts(E, H, F, backend="loop")
        w13, w2 = shard_expert_weights(
            full.w13.detach(), full.w2.detach(), ep_rank=coords["ep"], ep=2, etp_rank=coords["etp"], etp=2
        )
        for skew in (False, True):
            inputs = routed_inputs(300 + 10 * int(skew) + rank, skew, H, empty=skew and rank == 1)  # every rank its own
            results = []
            for fp8_rows in (spec, None):
                part = GroupedExperts(E // 2, H, F // 2, backend="loop")
                with torch.no_grad():
                    part.w13.copy_(w13)
                    part.w2.copy_(w2)
                disp = make_dispatcher(kind, groups, mesh.group("ep"), sp=True)
                disp.fp8_rows = fp8_rows
                out = run(disp, part, *inputs, weighted=skew, straight_through=None if fp8_rows else spec)
                results.append((*out, part.w13.grad, part.w2.grad))
            tag = f"{kind} sequence-parallel etp=2 ep=2 {spec} skew={skew} rank={rank}"
            for name, got, want in zip(("output", "grad x", "grad weights", "grad w13", "grad w2"), *results):
                check(f"{tag} {name}", got, want)
    dist.barrier()
    if rank == 0:
        print(f"OK {kind} sequence-parallel etp=2 ep=2", flush=True)


def layer_end_to_end(kind: str) -> None:
    """``MoELayer`` with FP8 experts over an EP4 dispatcher: with ``Fp8Config(dispatch=True)`` the layer
    asks the dispatcher for FP8 rows and hands them to its experts; output and gradients equal
    ``dispatch=False`` (rows moved in the activation dtype, quantized by the experts)."""
    from dataclasses import replace

    from lightning_moe.config import MoEConfig
    from lightning_moe.moe import MoELayer

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = FoldedMesh.build(FoldedLayout(world, ep=world), "cpu")
    H = 256
    for recipe in ("blockwise", "rowwise"):
        base = MoEConfig(
            hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, aux_loss="none", memory_efficient_permute=True,
            fp8=Fp8Config(recipe=recipe, backend="emulate"),
        )  # fmt: skip
        torch.manual_seed(0)
        full = MoELayer(base)
        x0 = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(50 + rank))
        results, asked = [], []
        for dispatch in (True, False):
            cfg = replace(base, fp8=replace(base.fp8, dispatch=dispatch))
            layer = MoELayer(cfg)
            layer.load_state_dict(full.state_dict())
            w13, w2 = shard_expert_weights(
                full.experts.w13.detach(), full.experts.w2.detach(), ep_rank=rank, ep=world, etp_rank=0, etp=1
            )
            layer.experts = GroupedExperts(E // world, H, F, fp8=cfg.fp8)
            with torch.no_grad():
                layer.experts.w13.copy_(w13)
                layer.experts.w2.copy_(w2)
            layer.dispatcher = make_dispatcher(kind, dict(ep_group=mesh.group("ep")), mesh.group("ep"))
            x = x0.clone().requires_grad_(True)
            y = layer(x)
            y.square().sum().backward()
            asked.append(layer.dispatcher.fp8_rows)
            grads = (layer.experts.w13.grad, layer.experts.w2.grad, layer.router.weight.grad)
            results.append((y.detach(), x.grad, *grads))
        if asked != [(recipe, "e4m3", False), None]:
            raise AssertionError(f"{kind} layer {recipe}: the layer asked its dispatcher for {asked}")
        for name, got, want in zip(("output", "grad x", "grad w13", "grad w2", "grad router"), *results):
            check(f"{kind} layer {recipe} rank={rank} {name}", got, want)
    dist.barrier()
    if rank == 0:
        print(f"OK {kind} layer", flush=True)


def wire_bytes(kind: str) -> None:
    """The bytes the row exchange moves: FP8 rows (data + scales, one uint8 row each) against bf16 rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = FoldedLayout(world, ep=world)
    mesh = FoldedMesh.build(layout, "cpu")
    H = 2048
    x, ids, w, _ = routed_inputs(7 + rank, skew=False, H=H, empty=False)
    moved: list[tuple[tuple[int, ...], torch.dtype, int]] = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):  # noqa: A002 (torch's own argument names)
        moved.append((tuple(input.shape), input.dtype, input.numel() * input.element_size()))
        return original(output, input, *args, **kwargs)

    results = {}
    for name, spec, dtype in (("bf16", None, torch.bfloat16), ("rowwise", ("rowwise", "e4m3", False), torch.float32),
                              ("blockwise", ("blockwise", "e4m3", False), torch.float32)):  # fmt: skip
        disp = make_dispatcher(kind, dict(ep_group=mesh.group("ep")), mesh.group("ep"))
        disp.fp8_rows = spec
        moved.clear()
        dist.all_to_all_single = counting
        try:
            _, handle = disp.dispatch(x.to(dtype), ids, w, None)
        finally:
            dist.all_to_all_single = original
        row_moves = [m for m in moved if len(m[0]) == 2 and m[0][1] >= H]  # the rows (not counts or weights)
        if len(row_moves) != 1:
            raise AssertionError(f"{kind} {name}: {len(row_moves)} row exchanges ({moved}); one carries data and scales")
        sent = sum(handle.send_splits if kind == "alltoall" else handle.layout.send_splits)
        per_row = 2 * H if spec is None else row_bytes(H, spec)
        if row_moves[0][2] != sent * per_row:
            raise AssertionError(f"{kind} {name}: {row_moves[0][2]} bytes moved, splits say {sent} rows * {per_row}")
        results[name] = (row_moves[0][2], sent)
    for name in ("rowwise", "blockwise"):
        ratio = results[name][0] / results["bf16"][0]
        if not 0.5 < ratio <= 0.516:
            raise AssertionError(f"{kind}: FP8 {name} rows move {ratio:.4f} of the bf16 bytes; expected about half")
    totals = torch.tensor([results[n][0] for n in ("bf16", "rowwise", "blockwise")], dtype=torch.float64)
    dist.all_reduce(totals)
    if rank == 0:
        bf16, row, block = totals.tolist()
        print(f"BYTES {kind} H={H} bf16={bf16:.0f} rowwise={row:.0f} ({row / bf16:.4f}) "
              f"blockwise={block:.0f} ({block / bf16:.4f})", flush=True)  # fmt: skip


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for spec_text in sys.argv[1:]:  # kind:tp:ep:etp, or bytes:kind
        head, _, rest = spec_text.partition(":")
        if head == "bytes":
            wire_bytes(rest)
        elif head == "sp":
            sequence_parallel_etp(rest)
        elif head == "layer":
            layer_end_to_end(rest)
        else:
            kind, tp, ep, etp = spec_text.split(":")
            main(kind, int(tp), int(ep), int(etp))
    dist.destroy_process_group()
