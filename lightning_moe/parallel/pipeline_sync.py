"""One FSDP2 gradient reduction per stage and step under the pipeline schedules.

torch's schedules run one backward per micro-batch and stage. A stage view is not an FSDP module
itself (its blocks, embedding, norm and head are, each on its own: the schedule calls them from
the views), so torch's ``PipelineStage`` would leave every backward to FSDP's hooks, and each
block would reduce-scatter its gradients ``n`` times per step, once per micro-batch.

:func:`sync_once_stage` builds a ``PipelineStage`` that counts the backwards of a step: when the
step is to reduce gradients at all (:func:`~lightning_moe.parallel.grad.gradient_sync_enabled`
before the step: not on an accumulating batch, where the strategy or Lightning's
``no_backward_sync`` turned reduction off), the first ``n - 1`` backwards accumulate unreduced
gradients and the ``n``-th reduces their sum, once. The count, not torch's ``last_backward``
flag, marks the last: the zero-bubble schedules pass ``last_backward=False`` to their input-gradient
step, which runs the full backward here. After the step the flag is back to what it was.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from lightning_moe.parallel.grad import gradient_sync_enabled, set_gradient_sync

__all__ = ["SyncOnceStage", "sync_once_stage"]


class SyncOnceStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP modules reduce gradients in the last of ``microbatches`` backwards only."""

    microbatches: int = 1
    _backwards: int = 0
    _sync_at_end: bool = False

    def begin_step(self) -> None:
        """Call before the schedule's step: reads whether this step reduces gradients."""
        self._backwards = 0
        self._sync_at_end = gradient_sync_enabled(self.submod)

    def end_step(self) -> None:
        """Call after the step (also after an error): the reduction flag as it was."""
        if self._sync_at_end:
            set_gradient_sync(self.submod, True)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        self._backwards += 1
        if self._sync_at_end:
            set_gradient_sync(self.submod, self._backwards == self.microbatches)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def sync_once_stage(
    view: nn.Module, index: int, num_stages: int, device: Any, microbatches: int, **kwargs: Any
) -> SyncOnceStage:
    """``PipelineStage(view, index, num_stages, device, **kwargs)`` that reduces gradients once per
    step of ``microbatches`` backwards."""
    stage = SyncOnceStage(view, index, num_stages, device, **kwargs)
    stage.microbatches = microbatches
    return stage
