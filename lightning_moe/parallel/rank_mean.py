"""The mean of a logged value over every rank, with one all-reduce and no barrier.

Lightning's ``self.log(..., sync_dist=True)`` puts a barrier before its all-reduce; on NCCL a barrier
waits for the device to finish the work queued so far, so a loss logged between the forward and the
backward leaves the device idle until the host has launched the backward's first kernels. The
all-reduce alone is ordered on the device like any other kernel and does not block the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["mean_over_ranks"]


def mean_over_ranks(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``value`` averaged over ``group`` (default: every rank); ``value`` itself on one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    world = dist.get_world_size(group)
    if world == 1:
        return value
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total / world
