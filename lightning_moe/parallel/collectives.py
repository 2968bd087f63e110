"""Collectives along one tensor dimension over a process group, with their autograd-free math.

``all_gather_cat`` and ``reduce_scatter_cat`` are adjoint: the first concatenates every rank's
tensor along ``dim`` in group-rank order, the second sums every rank's tensor and keeps this rank's
equal chunk along ``dim``. A group of one, or ``None``, needs no collective. The group is always an
argument; nothing here reads a global group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_cat", "group_size", "reduce_scatter_cat"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else group.size()


def all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on every rank) concatenated along ``dim`` in group-rank order."""
    world = group_size(group)
    if world == 1:
        return x
    x_front = x.movedim(dim, 0).contiguous()
    out = x_front.new_empty((world * x_front.shape[0], *x_front.shape[1:]))
    dist.all_gather_into_tensor(out, x_front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_cat(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Inverse of ``all_gather_cat`` for gradients: this rank's chunk along ``dim``, summed over ranks.

    ``x.shape[dim]`` must be a multiple of the group size (``ValueError`` otherwise)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(
            f"reduce_scatter_cat: dim {dim} has length {x.shape[dim]}, not a multiple of the group size {world}; "
            f"pad it to a multiple of {world}."
        )
    x_front = x.movedim(dim, 0).contiguous()  # chunk j (rows j*n .. (j+1)*n) goes to rank j
    n = x_front.shape[0] // world
    if group.name() == "gloo":  # an all_to_all and a local sum, which every torch release has
        recv = torch.empty_like(x_front)
        dist.all_to_all_single(recv, x_front, group=group)
        return recv.view(world, n, *x_front.shape[1:]).sum(0).movedim(0, dim)
    out = x_front.new_empty((n, *x_front.shape[1:]))
    dist.reduce_scatter_tensor(out, x_front, group=group)
    return out.movedim(0, dim)
