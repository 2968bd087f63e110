"""Gradients across the two meshes: expert scaling, no-sync accumulation, norm and clipping.

**Expert gradient scale** (parallel folding: experts laid out ``etp x ep x edp``). Dense parameters are averaged by FSDP over ``dp_cp``:
``g = 1/(DP*CP) * sum_s g_s`` over the DP*CP data shards s. An expert shard (expert g, ETP slice
j) receives, through the dispatcher, the tokens of every rank whose ETP coordinate is j: those
``W/ETP`` ranks cover each data shard ``TP/ETP`` times (tensor-parallel replicas hold the same
tokens). FSDP then averages over EDP. So the expert gradient is
``(TP/ETP)/EDP * sum_s g_s`` and must be multiplied by::

    scale = EDP * ETP / (TP * CP * DP)          (= 1/EP when PP = 1)

to end at the same data-parallel average. With TP = ETP = 1 this is DESIGN's ``EDP/(DP*CP)``.
It is applied once, to the reduce-scatter output, by an FSDP2 all-reduce hook (no extra pass,
and it only runs on the synchronising micro-batch).

**Norm and clipping.** ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which
fails when DTensors live on different meshes (dense ``dp_cp x tp``, experts ``edp x ep x etp``).
:func:`grad_norm` groups gradients by (mesh, placements), reduces each group over its own mesh
(the DTensor ``full_tensor`` of a norm: all-reduce over the mesh axes the gradient is sharded on),
and combines the group norms locally: every rank ends with the same global norm. With pipeline
parallel each stage holds other parameters: the stage's norm is combined over the ``pp`` group
as well (``pp_group``: one all-reduce of one number).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_moe.parallel.layout import FoldedLayout

__all__ = [
    "clip_grad_norm_",
    "clip_grad_value_",
    "expert_grad_scale",
    "grad_norm",
    "gradient_sync_enabled",
    "install_expert_grad_scaling",
    "set_gradient_sync",
]


def expert_grad_scale(layout: FoldedLayout) -> float:
    """``EDP*ETP / (TP*CP*DP)``: the factor that makes expert gradients a data-parallel average."""
    return layout.edp * layout.etp / (layout.tp * layout.cp * layout.dp)


def install_expert_grad_scaling(experts: FSDPModule, scale: float) -> None:
    """Multiply the experts' reduce-scattered gradients by ``scale`` (an FSDP2 all-reduce hook)."""
    if scale == 1.0:
        return

    def hook(reduce_output: torch.Tensor) -> None:
        reduce_output.mul_(scale)

    experts.set_all_reduce_hook(hook)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn FSDP2 gradient reduction on or off for every FSDP module under ``module``.

    Off during gradient accumulation: gradients accumulate unsharded and unreduced, and the
    first synchronising backward reduces the sum (one reduce-scatter per step, not per batch).
    """
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(enabled, recurse=False)


def gradient_sync_enabled(module: nn.Module) -> bool:
    """Whether the FSDP2 modules under ``module`` reduce their gradients in the next backward (as
    set by :func:`set_gradient_sync` or FSDP's own ``set_requires_gradient_sync``, which Lightning's
    ``no_backward_sync`` calls); ``True`` without any. FSDP2 keeps the flag on each parameter group,
    which has no public getter: the first group found answers."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # one group per module in older torch
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else []
            for group in groups:
                return bool(group.reduce_grads)
    return True


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: Any = None) -> torch.Tensor:
    """The global ``norm_type``-norm of all gradients, DTensors on any number of meshes.

    Collectives: per (mesh, placements) group, an all-reduce over the mesh axes on which the
    gradients are sharded (``full_tensor`` of a partial norm); with ``pp_group`` (the pipeline
    group: every rank holds other stages) one more all-reduce combines the stages. Returns a
    plain fp32 0-d tensor, equal on every rank.
    """
    norm_type = float(norm_type)
    groups: dict[object, list[torch.Tensor]] = {}
    for g in _grads(parameters):
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms: list[torch.Tensor] = []
    for key in groups:  # parameter order, the same on every rank: the collectives must match
        group_norm = torch.nn.utils.get_total_norm(groups[key], norm_type)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        norms.append(group_norm.float().reshape(()))
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.zeros(())
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return total
    return _combine_over(total, norm_type, pp_group)


def _combine_over(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The ``norm_type``-norm of the norms the ranks of ``group`` hold (one all-reduce)."""
    if math.isinf(norm_type):
        value = norm.detach().float().clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value
    value = norm.detach().double() ** norm_type
    dist.all_reduce(value, group=group)
    return (value ** (1.0 / norm_type)).float()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    pp_group: Any = None,
) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / (total_norm + 1e-6))``; returns the total norm
    (over every pipeline stage with ``pp_group``)."""
    params = list(parameters)
    total = grad_norm(params, norm_type, pp_group)
    if error_if_nonfinite and not math.isfinite(float(total)):  # SYNC: opt-in check
        raise RuntimeError(
            f"clip_grad_norm_: the total gradient norm is {float(total)}; lower the learning rate "
            "or pass error_if_nonfinite=False."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in _grads(params):
            local = _local(g)
            local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (local shards; no collective)."""
    with torch.no_grad():
        for g in _grads(parameters):
            _local(g).clamp_(-clip_value, clip_value)
