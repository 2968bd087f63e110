"""Materialization of a meta-device module and expert seeding, as a plain function.

A module built on the ``meta`` device (``trainer.init_module(empty_init=True)``,
``fabric.init_module(empty_init=True)``) gets storage on the device and its ``reset_parameters``
values after sharding (Lightning's ``_materialize_distributed_module``); its MoE layers' global
aux-loss counters, buffers without ``reset_parameters``, are zeroed. Its experts are then seeded
per global expert id, so every EP rank holds different experts and the values do not depend on
the layout; with an ``expert_init_seed`` an ordinary module is re-seeded the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from lightning.fabric.utilities.init import _materialize_distributed_module

from lightning_moe.moe.utils import reset_global_aux_counts
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import init_experts_by_id

__all__ = ["has_meta_parameters", "materialize_and_seed"]


def has_meta_parameters(module: nn.Module) -> bool:
    """True if any parameter of ``module`` lives on the ``meta`` device."""
    return any(p.is_meta for p in module.parameters())


def materialize_and_seed(
    module: nn.Module,
    root: nn.Module,
    device: torch.device,
    mesh: FoldedMesh,
    expert_init_seed: int | None,
    had_meta: bool,
) -> None:
    """Materialize ``root`` (what Lightning holds: ``module`` or a wrapper of it) on ``device``, then
    seed ``module``'s experts when it was built on meta (``had_meta``) or a seed is given."""
    _materialize_distributed_module(root, device)
    if had_meta:  # the layers' global aux-loss counters are buffers without reset_parameters
        reset_global_aux_counts(module)
    if had_meta or expert_init_seed is not None:
        init_experts_by_id(module, mesh, expert_init_seed if expert_init_seed is not None else 0)
