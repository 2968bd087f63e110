"""Differentiable collectives the expert-parallel dispatchers are built from.

Legend: R rows, H hidden. Every function takes its process group as a required argument
(never WORLD by default) and is an ``autograd.Function`` whose backward is the adjoint
collective:

============================  ==========================  ==========================
function                      forward                     backward
============================  ==========================  ==========================
``all_to_all_rows``           A2A(group), uneven splits   A2A(group), splits swapped
``copy_to_group``             identity                    all-reduce sum (group)
``reduce_from_group``         all-reduce sum (group)      identity
``all_gather_rows``           all-gather, uneven rows     reduce-scatter (sum), rows
``reduce_scatter_rows``       reduce-scatter (sum), rows  all-gather, rows
============================  ==========================  ==========================

``gather_expert_rows`` / ``scatter_expert_rows`` (expert tensor parallel under sequence parallel,
when the ETP ranks hold different tokens): all-gather(ETP) of the rows each rank received,
regrouped expert-major so every ETP rank computes its F slice for all of them; and the reverse,
reduce-scatter(ETP) of the row-parallel ``w2`` partial outputs back to the rows' owner (Megatron's
"gather from / reduce-scatter to the sequence-parallel region" over the expert-TP group).

``copy_to_group``/``reduce_from_group`` are Megatron's "copy to / reduce from the tensor-parallel
region": the first marks an input every rank of the group holds identically (its gradient is a
partial sum per rank), the second sums partial outputs.

``exchange_rows`` and ``all_to_all_rows`` take ``turns`` (a :class:`~lightning_moe.moe.dispatch.turns.CommTurns`,
``None`` by default): the all-to-all (and, for ``all_to_all_rows``, its backward's) is issued
asynchronously and the turn handed to the other side of an overlapped pipeline action before this
side waits for it (``moe/dispatch/turns.py``); without ``turns`` it completes before returning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.ops.permute import reorder_rows

__all__ = [
    "ExpertRowsLayout",
    "all_gather_rows",
    "all_to_all_rows",
    "check_etp_sequence_parallel",
    "copy_to_group",
    "exchange_rows",
    "gather_expert_rows",
    "reduce_from_group",
    "reduce_scatter_rows",
    "scatter_expert_rows",
]


def exchange_rows(
    x_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup, turns: CommTurns | None = None
) -> torch.Tensor:
    """Uneven all-to-all of rows, no autograd: ``in_splits[j]`` rows to rank j, ``out_splits[j]`` from it."""
    return _a2a(x_RH, out_splits, in_splits, group, turns)


def _a2a(
    x_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup, turns: CommTurns | None = None
) -> torch.Tensor:
    x_RH = x_RH.contiguous()
    out = x_RH.new_empty((sum(out_splits), *x_RH.shape[1:]))
    if turns is None:
        dist.all_to_all_single(out, x_RH, out_splits, in_splits, group=group)
        return out
    work = dist.all_to_all_single(out, x_RH, out_splits, in_splits, group=group, async_op=True)
    turns.hand_over()  # the other side of an overlapped pipeline action computes meanwhile
    work.wait()
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup,
        turns: CommTurns | None,
    ):  # fmt: skip
        ctx.splits = (out_splits, in_splits)
        ctx.group, ctx.turns = group, turns
        return _a2a(x_RH, out_splits, in_splits, group, turns)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad_RH, in_splits, out_splits, ctx.group, ctx.turns), None, None, None, None


def all_to_all_rows(
    x_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup, turns: CommTurns | None = None
) -> torch.Tensor:
    """Send ``in_splits[j]`` leading rows to rank j of ``group``, receive ``out_splits[j]`` from it."""
    return _AllToAllRows.apply(x_RH, out_splits, in_splits, group, turns)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced (summed) over ``group`` in backward."""
    return _CopyToGroup.apply(x, group)


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def reduce_from_group(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) partial results over ``group``; the gradient passes through unchanged."""
    return _ReduceFromGroup.apply(x, group)


def _gather_rows(x_RH: torch.Tensor, rows: list[int], group: ProcessGroup) -> torch.Tensor:
    # Uneven all-gather as an all-to-all: every rank sends its rows to every rank.
    n = len(rows)
    x_RH = x_RH.contiguous()
    send = x_RH.repeat((n,) + (1,) * (x_RH.dim() - 1)) if n > 1 else x_RH
    return _a2a(send, rows, [x_RH.shape[0]] * n, group)


def _scatter_rows(x_RH: torch.Tensor, rows: list[int], rank: int, group: ProcessGroup) -> torch.Tensor:
    # Uneven reduce-scatter as an all-to-all of the blocks followed by a local sum.
    n = len(rows)
    recv = _a2a(x_RH, [rows[rank]] * n, rows, group)
    return recv.view(n, rows[rank], *x_RH.shape[1:]).sum(0)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, rows: list[int], rank: int, group: ProcessGroup):  # type: ignore[override]
        ctx.args = (rows, rank, group)
        return _gather_rows(x_RH, rows, group)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        rows, rank, group = ctx.args
        return _scatter_rows(grad_RH, rows, rank, group), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, rows: list[int], rank: int, group: ProcessGroup):  # type: ignore[override]
        ctx.args = (rows, rank, group)
        return _scatter_rows(x_RH, rows, rank, group)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        rows, rank, group = ctx.args
        return _gather_rows(grad_RH, rows, group), None, None, None


def all_gather_rows(x_RH: torch.Tensor, rows: list[int], rank: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's rows (``rows[j]`` from rank j) in rank order; backward reduce-scatters."""
    return _AllGatherRows.apply(x_RH, rows, rank, group)


def reduce_scatter_rows(x_RH: torch.Tensor, rows: list[int], rank: int, group: ProcessGroup) -> torch.Tensor:
    """Sum the gathered layout over ranks and keep this rank's ``rows[rank]`` block; backward all-gathers."""
    return _ReduceScatterRows.apply(x_RH, rows, rank, group)


@dataclass(frozen=True)
class ExpertRowsLayout:
    """How :func:`gather_expert_rows` laid out the ETP group's rows (``scatter_expert_rows`` undoes it)."""

    rows: list[int]  # [Q] rows contributed by each ETP rank
    rank: int  # this rank in the ETP group
    group: ProcessGroup
    regroup_G: torch.Tensor  # source-major row -> expert-major position
    unregroup_G: torch.Tensor  # its inverse


def gather_expert_rows(
    x_RH: torch.Tensor, weights_R: torch.Tensor, tokens_per_expert_e: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExpertRowsLayout]:
    """All-gather over the ETP ``group`` the expert-major rows (and their weights) of every rank.

    Legend: Q ranks of the group, G rows gathered (``sum`` of every rank's R). Returns
    ``x_GH`` and ``weights_G`` expert-major (``[expert][source rank]``), the rows per local
    expert of the whole group, and the layout. Collectives: all-gather(ETP) of the ``[e]`` counts
    (# SYNC: the row counts go to the host), all-gather(ETP) of the rows and of the weights; the
    backward reduce-scatters the gradients (each rank's is partial over its F slice).
    """
    Q, e = group.size(), tokens_per_expert_e.shape[0]
    counts_Qe = tokens_per_expert_e.new_empty(Q * e)
    dist.all_gather_into_tensor(counts_Qe, tokens_per_expert_e.contiguous(), group=group)
    counts_Qe = counts_Qe.view(Q, e)
    rows = counts_Qe.sum(1).tolist()  # SYNC: the gathered buffers' sizes
    rank = group.rank()
    x_GH = all_gather_rows(x_RH, rows, rank, group)
    w_G = all_gather_rows(weights_R, rows, rank, group)
    expert_of_row_G = torch.repeat_interleave(torch.arange(e, device=counts_Qe.device).repeat(Q), counts_Qe.reshape(-1))
    regroup_G = torch.argsort(expert_of_row_G, stable=True)
    unregroup_G = torch.empty_like(regroup_G)
    unregroup_G[regroup_G] = torch.arange(regroup_G.numel(), device=regroup_G.device)
    x_GH = reorder_rows(x_GH, regroup_G, unregroup_G)
    w_G = reorder_rows(w_G, regroup_G, unregroup_G)
    return x_GH, w_G, counts_Qe.sum(0), ExpertRowsLayout(rows, rank, group, regroup_G, unregroup_G)


def check_etp_sequence_parallel(owner: str, value: object) -> bool:
    """``etp_sequence_parallel`` must be a bool (``TypeError`` naming the value)."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: etp_sequence_parallel={value!r} must be a bool; pass True or False.")
    return value


def scatter_expert_rows(y_GH: torch.Tensor, layout: ExpertRowsLayout) -> torch.Tensor:
    """The expert-major partial outputs of :func:`gather_expert_rows`'s rows, summed over the ETP
    group, back as this rank's own ``y_RH`` (reduce-scatter(ETP); backward all-gathers)."""
    y_GH = reorder_rows(y_GH, layout.unregroup_G, layout.regroup_G)
    return reduce_scatter_rows(y_GH, layout.rows, layout.rank, layout.group)
