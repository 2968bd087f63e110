"""Sequence parallel in the tensor-parallel region: the residual stream sharded along the sequence.

Legend: B batch, S sequence, s = S/tp this rank's slice of it, H hidden, tp the TP group size.

With sequence parallel (Megatron-Core's "sequence parallelism", Korthikanti et al. 2022) the
activations outside attention and the MLPs — the residual stream, the norms, the MoE layers —
are held as ``[B, s, H]``: each TP rank keeps ``S/tp`` positions. Entering a TP region they are
all-gathered along the sequence; leaving it, the row-parallel projection's partial sums are
reduce-scattered along the sequence instead of all-reduced. Collectives here (every function is
an ``autograd.Function`` whose backward is the adjoint collective; the group is an argument):

=================================  ===============================  ================================
function                           forward                          backward
=================================  ===============================  ================================
``scatter_to_sequence``            keep this rank's slice (local)   all-gather(TP) along the sequence
``gather_from_sequence``           all-gather(TP) along the seq.    this rank's slice (local), or
                                                                    reduce-scatter(TP) when the
                                                                    consumers' gradients are partial
``reduce_scatter_to_sequence``     reduce-scatter(TP) along seq.    all-gather(TP) along the sequence
=================================  ===============================  ================================

Parameters replicated over TP whose module sees only this rank's slice (the norms, the router,
the shared expert) get their gradients summed over TP: :func:`sum_grads_over_tp` makes each a
``Replicate`` DTensor over the TP mesh and lets the module compute on its local tensor, whose
gradient is declared ``Partial`` (a sum over TP, taken by FSDP2 or the first DTensor op reading
it). ``parallel/parallelize.py`` decides which module gets which.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from lightning_moe.parallel.collectives import all_gather_cat, reduce_scatter_cat

__all__ = [
    "check_sequence_length",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "sum_grads_over_tp",
]


def check_sequence_length(S: int, tp: int, owner: str = "sequence_parallel") -> None:
    """``S`` must split evenly over the ``tp`` ranks of the TP group (``ValueError`` naming both)."""
    if S % tp:
        raise ValueError(
            f"{owner}: sequence length {S} is not divisible by the TP group size {tp}; "
            f"use sequences of a multiple of {tp} tokens or turn sequence_parallel off."
        )


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    check_sequence_length(x.shape[dim], group.size())
    return reduce_scatter_cat(x, group, dim)


def _slice(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    tp = group.size()
    check_sequence_length(x.shape[dim], tp)
    return x.chunk(tp, dim=dim)[group.rank()].contiguous()


class _ToSequenceShard(torch.autograd.Function):
    """This rank's sequence slice of a whole tensor (``reduce=False``) or of a sum of partial ones
    (``reduce=True``); either way backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, reduce: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group) if reduce else _slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return all_gather_cat(grad, ctx.group, ctx.dim), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, partial: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.group, ctx.partial = dim, group, partial
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        if ctx.partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _slice(grad, ctx.dim, ctx.group), None, None, None


def scatter_to_sequence(x_BSH: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """``[B, S, H] -> [B, s, H]``: this rank's slice of a tensor every TP rank holds whole.

    Backward all-gathers the slices' gradients, so every rank gets the whole (equal) gradient.
    """
    return _ToSequenceShard.apply(x_BSH, dim, group, False)


def gather_from_sequence(
    x_BsH: torch.Tensor, group: ProcessGroup, dim: int = 1, *, partial_grad: bool = False
) -> torch.Tensor:
    """``[B, s, H] -> [B, S, H]``: all-gather along the sequence over the TP group.

    ``partial_grad=False``: the consumer is replicated over TP (every rank computes the same,
    whole gradient), so backward keeps this rank's slice. ``True``: the consumer is
    tensor-parallel (each rank's gradient is a partial sum), so backward reduce-scatters.
    """
    return _Gather.apply(x_BsH, dim, group, partial_grad)


def reduce_scatter_to_sequence(x_BSH: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """``[B, S, H]`` partial sums -> ``[B, s, H]``: summed over TP, this rank's slice kept.

    Backward all-gathers the gradient (each rank's partial input saw the whole output).
    """
    return _ToSequenceShard.apply(x_BSH, dim, group, True)


def _local_params_pre_hook(module: nn.Module, args: Any) -> None:
    # The module computes on plain tensors; their gradients are partial sums over TP.
    saved = {}
    for name, p in list(module._parameters.items()):
        if isinstance(p, DTensor):
            saved[name] = p
            module._parameters[name] = p.to_local(grad_placements=(Partial(),))  # type: ignore[assignment]
    module._sp_saved_params = saved  # type: ignore[assignment]


def _local_params_post_hook(module: nn.Module, args: Any, output: Any) -> None:
    saved = module.__dict__.pop("_sp_saved_params", {})
    for name, p in saved.items():
        module._parameters[name] = p


def sum_grads_over_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every parameter under ``module`` becomes a ``Replicate`` DTensor over ``tp_mesh``; each
    owning submodule runs on the local tensors, whose gradients are ``Partial`` over TP.

    For modules that see only this rank's sequence slice: the sum over TP of their gradients is
    the gradient of the whole sequence. The values must already be equal on every TP rank (the
    same initialisation seed, or a broadcast); no collective here.
    """
    for sub in module.modules():
        own = [(n, p) for n, p in sub._parameters.items() if p is not None and not isinstance(p, DTensor)]
        if not own:
            continue
        for name, p in own:
            dt = DTensor.from_local(p.data, tp_mesh, [Replicate()], run_check=False)
            sub.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        sub.register_forward_pre_hook(_local_params_pre_hook)
        sub.register_forward_hook(_local_params_post_hook, always_call=True)
