"""Expert all-to-all of one micro-batch in flight while another micro-batch computes (pipeline steady state).

torch's ``ScheduleDualPipeV`` pairs, in its steady state, the forward of one micro-batch on one of
this rank's stages with the backward of another micro-batch on its other stage: one
``OVERLAP_F_B`` action, which torch runs as the forward, then the backward. With
``pp_overlap_expert_comm=True`` the runner registers :func:`overlapped_forward_backward` for that
action (``register_custom_function`` of torch's runtime schedules): it waits for the two
sub-actions' pipeline receives, then runs the forward and the backward as two sides of a
:class:`~lightning_moe.moe.dispatch.turns.CommTurns` (the forward on this thread, the backward on a
helper thread, never at the same time): each side's expert all-to-all is issued asynchronously and
the other side computes until its own all-to-all, so the communication of one micro-batch is in
flight while the other computes (Megatron-Core's combined 1F1B, DeepSeek's DualPipe overlap).
:func:`attach_comm_turns` gives the turns to the dispatchers of this rank's MoE layers.

Each sub-action does what torch's runtime does for a ``FORWARD`` and a ``FULL_BACKWARD`` action
(the loss on the last stage, the backward counter that marks a stage's last backward, the hand-off
between two stages of this rank); the arithmetic and its order per stage are unchanged.
Activation recompute (``TransformerConfig.recompute`` ``["moe"]`` or ``["block"]``) runs an MoE
layer's forward again inside the backward: on the backward side, whose recomputed all-to-alls take
turns like its own. The other collectives of both sides (tensor and expert-tensor parallel,
sequence parallel, FSDP) are issued in each side's program order between the hand-overs, and every
rank of such a group holds the same pp coordinate (the same stages and actions), so each group's
order is the same on all its ranks.

Which torch schedules have such a steady state: :data:`OVERLAPPING_SCHEDULES`, checked against
the installed torch by :func:`check_overlap_schedule`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.moe.layer import MoELayer

__all__ = [
    "OVERLAPPING_SCHEDULES",
    "attach_comm_turns",
    "check_overlap_schedule",
    "overlapped_forward_backward",
    "register_overlap",
]

# schedule names (parallel/pipeline.py) whose torch class emits OVERLAP_F_B actions
OVERLAPPING_SCHEDULES = ("dualpipev",)


def _torch_overlap_support() -> str | None:
    """``None`` when this torch runs custom ``OVERLAP_F_B`` actions, else what it lacks."""
    from torch.distributed.pipelining import schedules

    computation = getattr(schedules, "_ComputationType", None)
    if computation is None or not hasattr(computation, "OVERLAP_F_B"):
        return "the OVERLAP_F_B schedule action"
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if runtime is None or not hasattr(runtime, "register_custom_function"):
        return "register_custom_function on its runtime schedules"
    return None


def check_overlap_schedule(owner: str, schedule: str) -> None:
    """``schedule`` has overlapped forward+backward actions in this torch (``ValueError`` naming the fix)."""
    import torch

    if schedule not in OVERLAPPING_SCHEDULES:
        raise ValueError(
            f"{owner}: pp_overlap_expert_comm=True with pp_schedule={schedule!r}: this schedule has no steady state "
            f"that runs one micro-batch's forward with another's backward; use pp_schedule in "
            f"{list(OVERLAPPING_SCHEDULES)}, or pp_overlap_expert_comm=False."
        )
    missing = _torch_overlap_support()
    if missing is not None:
        raise ValueError(
            f"{owner}: pp_overlap_expert_comm=True needs {missing}, which torch {torch.__version__} lacks; "
            "upgrade torch or set pp_overlap_expert_comm=False."
        )


def attach_comm_turns(module: nn.Module, turns: CommTurns | None) -> int:
    """Give ``turns`` to the dispatcher (or its token exchange) of every MoE layer in ``module``;
    returns how many layers got it. ``ValueError`` for a dispatcher without overlap."""
    count = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        target = getattr(layer.dispatcher, "exchange", layer.dispatcher)
        if not hasattr(type(target), "comm_turns"):
            raise ValueError(
                f"attach_comm_turns: the MoE layer {getattr(layer, 'layer_name', None) or name!r} dispatches with {type(target).__name__}, whose "
                "communication cannot overlap another micro-batch; use dispatcher='alltoall' or 'alltoall_dedup', "
                "or pp_overlap_expert_comm=False."
            )
        target.comm_turns = turns
        count += 1
    return count


def register_overlap(schedule: Any, turns: CommTurns) -> None:
    """Run ``schedule``'s ``OVERLAP_F_B`` actions with :func:`overlapped_forward_backward`."""
    from torch.distributed.pipelining.schedules import _ComputationType

    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, overlapped_forward_backward(turns))


def overlapped_forward_backward(turns: CommTurns) -> Callable[[Any, Any], None]:
    """The ``OVERLAP_F_B`` action of torch's runtime schedule as two sides of ``turns`` (module docstring)."""

    def run(action: Any, ctx: Any) -> None:
        schedule = ctx.schedule_ref
        forward, backward = action.sub_actions
        stages = {stage.stage_index: stage for stage in schedule._stages}
        _wait_receives(schedule, stages, forward, backward)
        turns.run_pair(
            lambda: _forward(schedule, stages, forward, ctx),
            lambda: _backward(schedule, stages, backward),
            name=f"pipeline-backward-stage{backward.stage_index}-mb{backward.microbatch_index}",
        )

    return run


def _wait_receives(schedule: Any, stages: dict[int, Any], forward: Any, backward: Any) -> None:
    """The forward's input and the backward's output gradient, received from the neighbouring ranks
    (none from a stage of this rank: the "V" hands them over locally)."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    f_stage, b_stage = stages[forward.stage_index], stages[backward.stage_index]
    if not f_stage.is_first and forward.stage_index - 1 not in stages:
        _wait_batch_p2p(_pop_receive(schedule.fwd_recv_ops, forward))
    if not b_stage.is_last and backward.stage_index + 1 not in stages:
        _wait_batch_p2p(_pop_receive(schedule.bwd_recv_ops, backward))


def _pop_receive(pending: dict[tuple[int, int], Any], action: Any) -> Any:
    key = (action.stage_index, action.microbatch_index)
    if key not in pending:
        raise RuntimeError(f"overlapped_forward_backward: {action} runs before its input was received.")
    return pending.pop(key)


def _forward(schedule: Any, stages: dict[int, Any], action: Any, ctx: Any) -> None:
    """torch's ``FORWARD`` action: the stage's forward, the loss on the last stage, the output to
    the next stage when this rank holds it."""
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if index + 1 in stages:
        stages[index + 1].set_local_fwd_input(output, mb)


def _backward(schedule: Any, stages: dict[int, Any], action: Any) -> None:
    """torch's ``FULL_BACKWARD`` action: the stage's backward (its last of the step marked), the
    input gradient to the previous stage when this rank holds it."""
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[index] += 1
    last_backward = schedule.backward_counter[index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
