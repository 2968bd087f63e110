"""Model parallelization for the folded mesh, context parallel included, as plain functions.

:class:`ModulePlan` is what sharding a module needs to know (the mesh, the dispatcher, the
tensor-parallel options, the expert seed); a strategy builds one from its arguments and mesh
(``strategy.module_plan``), and a user can build one by hand from a :class:`FoldedMesh`.

1. :func:`check_module_to_shard`: the ``lightning`` namespace and no FSDP1 modules;
2. :func:`check_model_for_context_parallel`: with ``cp > 1`` the attention can be wrapped and no MoE
   layer uses ``aux_loss="seq"`` (no collective);
3. :func:`enable_context_parallel_on`: with ``cp > 1`` every attention attends over the CP group;
4. :func:`parallelize_module`: ``parallelize_moe_model`` (TP, experts over EP/ETP, FSDP2) unless
   the module is sharded already (``configure_model`` did it);
5. :func:`sum_aux_counts_over_sequences`: with ``cp > 1`` the switch aux-loss counts are summed over
   the ranks that hold the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from lightning_moe.models.context_parallel import enable_context_parallel
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import DispatcherKind, check_model_for_layout, parallelize_moe_model
from lightning_moe.strategies.layout import check_namespace, context_parallel_of

__all__ = [
    "ModulePlan",
    "check_model_for_context_parallel",
    "check_module_to_shard",
    "enable_context_parallel_on",
    "is_sharded",
    "parallel_options",
    "parallelize_module",
    "sum_aux_counts_over_sequences",
]


@dataclass(frozen=True)
class ModulePlan:
    """How to lay a module out on ``mesh``.

    ``owner`` names the class in errors; ``expert_init_seed`` re-seeds the experts per global
    expert id (always done, seed 0 when ``None``, for a module built on the meta device).
    """

    owner: str
    mesh: FoldedMesh
    dispatcher: DispatcherKind = "alltoall_dedup"
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    expert_init_seed: int | None = None

    def parallel_options(self) -> dict[str, bool]:
        """``sequence_parallel``/``vocab_parallel`` for ``parallelize_moe_model``, only those turned on."""
        return parallel_options(self.sequence_parallel, self.vocab_parallel)


def parallel_options(sequence_parallel: bool, vocab_parallel: bool) -> dict[str, bool]:
    """The keyword arguments of ``parallelize_moe_model`` for the options turned on."""
    return {k: True for k, on in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel)) if on}


def check_module_to_shard(owner: str, module: nn.Module) -> None:
    """Refuse a ``pytorch_lightning`` module and one holding FSDP1 modules (``TypeError``)."""
    check_namespace(module, owner)
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            f"{owner}: {type(module).__name__} holds torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) "
            "modules; pass the unwrapped module: the strategy shards it with FSDP2 (fully_shard)."
        )


def check_model_for_context_parallel(owner: str, module: nn.Module, cp: int) -> None:
    """With ``cp > 1``: attention that context parallel cannot wrap raises ``TypeError`` naming the
    module (``enable_context_parallel``'s check, nothing enabled yet); no MoE layer may use
    ``aux_loss="seq"`` (its per-sequence counts would see only this rank's chunks): ``ValueError``
    naming the layer. No collective."""
    if cp == 1:
        return
    try:
        enable_context_parallel(module, None)  # checks every attention module; the group stays unset
    except ValueError:
        pass  # no attention at all yet: a module that configure_model builds is checked when it is sharded
    for name, m in module.named_modules():
        if isinstance(m, MoELayer) and m.config.aux_loss == "seq":
            raise ValueError(
                f"{owner}: cp={cp} with aux_loss='seq' at {name!r} is not supported: each context-parallel "
                "rank holds only chunks of every sequence; use aux_loss='switch' or 'global', or cp=1."
            )


def enable_context_parallel_on(module: nn.Module, mesh: FoldedMesh) -> None:
    """With ``cp > 1``: every attention of ``module`` attends over the CP group.

    ``enable_context_parallel`` raises for attention it cannot wrap, naming the module, before
    anything changes (and before ``parallelize_moe_model``).
    """
    cp = context_parallel_of(mesh)
    if cp.group is None:
        return
    enable_context_parallel(module, cp.group)


def is_sharded(module: nn.Module) -> bool:
    """True if ``module`` was sharded already (FSDP2 modules or DTensor parameters inside)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def parallelize_module(module: nn.Module, plan: ModulePlan, shard_root: bool = False) -> None:
    """``parallelize_moe_model`` over ``plan.mesh`` (after the layout checks) unless ``module`` is
    sharded already; ``shard_root`` also FSDP-shards the root (a plain module under Fabric)."""
    if is_sharded(module):
        return
    check_model_for_layout(module, plan.mesh.layout, **plan.parallel_options())
    parallelize_moe_model(
        module, mesh=plan.mesh, dispatcher=plan.dispatcher, shard_root=shard_root, **plan.parallel_options()
    )


def sum_aux_counts_over_sequences(module: nn.Module, mesh: FoldedMesh, sequence_parallel: bool) -> None:
    """With ``cp > 1``: MoE switch aux-loss counts summed over the ranks holding the sequences.

    Each MoE layer routes only this rank's tokens; its switch aux loss takes the per-expert
    counts of the whole sequences with the local probabilities, so the CP average of the local
    losses (FSDP's gradient average over ``dp_cp``) is the loss of the whole sequences. With
    sequence parallel the TP ranks hold shards of the same sequences too: counts over ``tp_cp``.
    """
    cp = context_parallel_of(mesh)
    if cp.group is None:
        return
    group = mesh.group("tp_cp") if sequence_parallel and mesh.layout.tp > 1 else cp.group
    for m in module.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_sequence_group = group
