"""The steps that prepare a module for a folded strategy, in order, as one plain function.

:func:`prepare_module` runs, for ``module`` and the :class:`~lightning_moe.strategies.sharding.ModulePlan`:

1. ``check``: the namespace, no FSDP1, the context-parallel checks (no collective);
2. ``context parallel``: attention over the CP group (``cp > 1``), also for a module that
   ``configure_model`` sharded already;
3. ``parallelize``: TP, experts over EP/ETP and FSDP2, unless sharded already (a pipeline split
   into stages belongs right before this step: each stage is then parallelized on its own);
4. ``aux-loss counts``: summed over the ranks that hold the same sequences (``cp > 1``);
5. ``materialize and seed``: a meta-device module gets storage and values, its experts a seed per
   global expert id.

The Trainer's strategy calls it from ``setup``; the Fabric strategy hands it to Lightning as its
``parallelize_fn``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_moe.strategies.materialize import has_meta_parameters, materialize_and_seed
from lightning_moe.strategies.sharding import (
    ModulePlan,
    check_model_for_context_parallel,
    check_module_to_shard,
    enable_context_parallel_on,
    parallelize_module,
    sum_aux_counts_over_sequences,
)

__all__ = ["prepare_module"]


def prepare_module(
    module: nn.Module,
    plan: ModulePlan,
    device: torch.device,
    root: nn.Module | None = None,
    shard_root: bool = False,
) -> nn.Module:
    """Shard ``module`` for ``plan.mesh``, materialise it (``root`` too), seed its experts; returns it.

    ``root`` is what Lightning holds (a wrapper around ``module`` or ``module`` itself) and is
    materialised; ``shard_root`` also FSDP-shards the root (Fabric passes a plain module).
    """
    check_module_to_shard(plan.owner, module)
    had_meta = has_meta_parameters(module)
    check_model_for_context_parallel(plan.owner, module, plan.mesh.layout.cp)
    enable_context_parallel_on(module, plan.mesh)
    parallelize_module(module, plan, shard_root=shard_root)
    sum_aux_counts_over_sequences(module, plan.mesh, plan.sequence_parallel)
    materialize_and_seed(module, root if root is not None else module, device, plan.mesh, plan.expert_init_seed, had_meta)
    return module
