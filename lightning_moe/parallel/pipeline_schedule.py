"""Pipeline schedules by name: torch's ``torch.distributed.pipelining`` classes behind checked names.

``build_schedule(name, stages, n_microbatches, loss_fn)`` checks the name, the number of local
stages and the micro-batch count (``parallel/pipeline.py``) before torch sees them, then returns
torch's schedule. By default gradients are averaged over the micro-batches (``scale_grads=True``):
with a ``loss_fn`` that returns a micro-batch's mean loss, the gradients are those of the mean over
the step's micro-batches, and an MoE layer's aux losses (attached to its output by
``AuxLossScaler``) enter them with ``aux_loss_scale = 1``. With ``scale_grads=False`` the
gradients are the sum over the micro-batches: ``loss_fn`` carries the normalisation itself (the
strategies divide by the step's labelled tokens), and the aux losses need
``aux_loss_scale = 1 / n_microbatches``. With ``turns`` (a schedule of
``pipeline_overlap.OVERLAPPING_SCHEDULES``) the overlapped forward+backward actions run as two sides
taking turns at their expert all-to-alls (``parallel/pipeline_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.parallel.pipeline import SCHEDULES, check_microbatches, check_schedule
from lightning_moe.parallel.pipeline_overlap import check_overlap_schedule, register_overlap

__all__ = ["build_schedule"]


def build_schedule(
    name: str,
    stages: list[Any],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scale_grads: bool = True,
    turns: CommTurns | None = None,
) -> Any:
    """torch's schedule ``name`` over this rank's ``PipelineStage`` objects (one, or ``virtual_stages``);
    with ``turns`` its overlapped forward+backward actions take turns at their all-to-alls."""
    import torch.distributed.pipelining as pipelining

    if not isinstance(stages, list) or not stages:
        raise ValueError(f"build_schedule: stages={stages!r} must be a non-empty list of this rank's PipelineStage.")
    check_schedule(name, len(stages))
    pp = stages[0].group_size
    check_microbatches(name, n_microbatches, pp, len(stages))
    if turns is not None:
        check_overlap_schedule("build_schedule", name)
    cls = getattr(pipelining, SCHEDULES[name].torch_class)
    if SCHEDULES[name].placement == "single":
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if turns is not None:
        register_overlap(schedule, turns)
    return schedule
