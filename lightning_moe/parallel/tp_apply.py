"""Apply a :mod:`~lightning_moe.parallel.tp_plans` entry to one module over the TP mesh.

Legend: B batch, S sequence, W a projection's full output width (all heads), tp the TP group size.

:func:`check_tp_plans` (no collective) refuses what cannot be cut: a refused or unknown
attention class, head counts ``tp`` does not divide, a plan naming a projection the module lacks.
:func:`apply_attention_plan` / :func:`apply_mlp_plan` shard the named projections with
``ColwiseParallel`` / ``RowwiseParallel`` and add the plan's extra collectives:

==============================  =====================================  ===============================
piece                           forward                                backward
==============================  =====================================  ===============================
full-width norm's projection    all-gather(TP) of its ``[B, S, W/tp]``  this rank's columns (local)
  (``full_width_norms``)        output
after the full-width norm       this rank's columns (local)            all-gather(TP) of the gradient
shared rotary columns           identity                               all-reduce(TP) of the gradient
  (``shared_rope``)                                                    of those columns
per-head parameters             this rank's values (``Shard(0)``,      the local gradient (``Shard(0)``)
  (``head_params``)             local)
==============================  =====================================  ===============================
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel, parallelize_module

from lightning_moe.parallel.tp_plans import (
    ATTENTION_PLANS,
    AttentionPlan,
    HeadCount,
    MLPPlan,
    attention_plan_of,
    is_attention_like,
    mlp_plan_of,
    resolve_linear,
)

__all__ = ["apply_attention_plan", "apply_mlp_plan", "check_tp_plans", "head_count", "tp_targets"]


def tp_targets(module: nn.Module) -> list[tuple[str, nn.Module, AttentionPlan | MLPPlan | None]]:
    """Every attention-like or dense-MLP module under ``module`` with its plan (``None``: none known)."""
    found: list[tuple[str, nn.Module, AttentionPlan | MLPPlan | None]] = []
    for name, m in module.named_modules():
        attn = attention_plan_of(m)
        if attn is not None or is_attention_like(m):
            found.append((name, m, attn))
            continue
        mlp = mlp_plan_of(m)
        if mlp is not None:
            found.append((name, m, mlp))
    return found


def head_count(module: nn.Module, count: HeadCount) -> int:
    """Heads in ``count.proj``'s output (``HeadCount`` doc)."""
    proj = resolve_linear(module, count.proj)
    assert proj is not None  # checked by check_tp_plans
    width = sum(int(getattr(module, w)) for w in count.widths) * count.per_head
    return getattr(module, proj).out_features // width


def check_tp_plans(module: nn.Module, tp: int, owner: str = "FoldedMoEStrategy") -> None:
    """Raise ``ValueError`` for a module ``tp > 1`` cannot cut (module doc); collective-free."""
    for name, m, plan in tp_targets(module):
        where = f"{name or 'the model'} ({type(m).__name__})"
        if plan is None:
            raise ValueError(
                f"{owner}: tp={tp} is unsupported for {where}: no tensor-parallel plan is known for this attention "
                f"class (known: {sorted(ATTENTION_PLANS)}). Use tp=1 for this model."
            )
        if isinstance(plan, MLPPlan):
            continue
        if plan.refused is not None:
            raise ValueError(f"{owner}: tp={tp} is unsupported for {where}: {plan.refused}. Use tp=1 for this model.")
        names = [*plan.colwise, *plan.rowwise, plan.query_heads.proj, plan.kv_heads.proj]
        names += [p for _, p in plan.full_width_norms] + ([plan.shared_rope[0]] if plan.shared_rope else [])
        missing = [n for n in names if resolve_linear(m, n) is None]
        missing += [n for n in plan.replicated if not isinstance(getattr(m, n, None), nn.Module)]
        missing += [n for n in plan.head_params if not isinstance(m._parameters.get(n), nn.Parameter)]
        if missing:
            raise ValueError(
                f"{owner}: {where} has no {sorted(set(missing))} that its tensor-parallel plan names; this version of "
                "the class differs from the one the plan was written for. Use tp=1 for this model."
            )
        heads, kv = head_count(m, plan.query_heads), head_count(m, plan.kv_heads)
        for n in plan.head_params:
            if m._parameters[n].shape[0] != heads:
                raise ValueError(
                    f"{owner}: {where}.{n} has {m._parameters[n].shape[0]} values for {heads} query heads; its "
                    "tensor-parallel plan cuts one per head. Use tp=1 for this model."
                )
        if heads % tp or kv % tp:
            raise ValueError(
                f"{owner}: tp={tp} must divide the {heads} query and {kv} key/value heads of {where}; "
                f"choose tp dividing {math.gcd(heads, kv)}."
            )


def apply_mlp_plan(m: nn.Module, plan: MLPPlan, tp_mesh: DeviceMesh, row: Callable[[], ParallelStyle]) -> None:
    styles: dict[str, ParallelStyle] = {n: ColwiseParallel() for n in plan.colwise}
    parallelize_module(m, tp_mesh, styles | {n: row() for n in plan.rowwise})


def apply_attention_plan(
    m: nn.Module, plan: AttentionPlan, tp_mesh: DeviceMesh, row: Callable[[], ParallelStyle]
) -> None:
    gathered = {proj for _, proj in plan.full_width_norms}
    styles: dict[str, ParallelStyle] = {}
    for names in plan.colwise:
        proj = resolve_linear(m, names)
        assert proj is not None  # checked by check_tp_plans
        # a full-width norm needs every head: the projection's output is all-gathered for it
        styles[proj] = ColwiseParallel(output_layouts=Replicate()) if proj in gathered else ColwiseParallel()
    for proj in plan.rowwise:
        styles[proj] = row()
    for norm in plan.head_norms:
        child = getattr(m, norm, None)
        if isinstance(child, nn.Module) and any(True for _ in child.parameters()):
            # this rank's heads only: the shared weight is a Replicate DTensor, its partial gradients summed
            styles[norm] = SequenceParallel(sequence_dim=plan.heads_dim, use_local_output=True)
    parallelize_module(m, tp_mesh, styles)
    for norm, _ in plan.full_width_norms:
        getattr(m, norm).register_forward_hook(functools.partial(_local_heads, tp_mesh))
    if plan.head_params:
        _shard_head_params(m, plan.head_params, tp_mesh)
    if plan.shared_rope is not None:
        proj, attr = plan.shared_rope
        hook = functools.partial(_sum_shared_columns_grad, tp_mesh.get_group(), int(getattr(m, attr)))
        getattr(m, proj).register_forward_hook(hook)


def _local_heads(tp_mesh: DeviceMesh, module: nn.Module, args: Any, out_BSW: torch.Tensor) -> torch.Tensor:
    """``[B, S, W]`` (the same on every rank) -> this rank's ``[B, S, W/tp]``; backward all-gathers."""
    full = DTensor.from_local(out_BSW, tp_mesh, [Replicate()], run_check=False)
    return full.redistribute(tp_mesh, [Shard(out_BSW.ndim - 1)]).to_local()


def _shard_head_params(m: nn.Module, names: tuple[str, ...], tp_mesh: DeviceMesh) -> None:
    """``m.<name> [N]`` -> a ``Shard(0)`` DTensor of this rank's heads' values (cut locally, no
    collective: every rank holds the same values); ``m`` computes on the local tensor."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for name in names:
        p = m._parameters[name]
        assert p is not None
        local = p.detach().chunk(tp, dim=0)[rank].contiguous()
        dt = DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        m.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
    m.register_forward_pre_hook(functools.partial(_local_head_params, names))
    m.register_forward_hook(_restore_head_params, always_call=True)


def _local_head_params(names: tuple[str, ...], module: nn.Module, args: Any) -> None:
    saved = {n: module._parameters[n] for n in names}
    for n, p in saved.items():
        module._parameters[n] = p.to_local()  # type: ignore[union-attr, assignment]
    module._tp_saved_head_params = saved  # type: ignore[assignment]


def _restore_head_params(module: nn.Module, args: Any, output: Any) -> None:
    module._parameters.update(module.__dict__.pop("_tp_saved_head_params", {}))


class _SumColumnsGrad(torch.autograd.Function):
    """Identity; the gradient of columns ``start:`` is all-reduced over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, start: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.start = group, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone()
        shared = grad[..., ctx.start :].contiguous()
        dist.all_reduce(shared, group=ctx.group)
        grad[..., ctx.start :] = shared
        return grad, None, None


def _sum_shared_columns_grad(group: ProcessGroup, start: int, module: nn.Module, args: Any, out: torch.Tensor) -> Any:
    return _SumColumnsGrad.apply(out, group, start)
