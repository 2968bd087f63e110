"""Context parallelism wired into the model: every ``Attention`` of it attends across the CP group.

The sharding, the collectives and the attention math across the group are the parallel layer's
(:mod:`lightning_moe.parallel.context`); this is the model's own step that hands the group to its
attention modules. The strategies call :func:`enable_context_parallel` on the module they shard
when ``cp > 1``; after it the model's forward takes this rank's shard of every sequence, with
``position_ids_BS`` its global positions (:func:`~lightning_moe.parallel.context.cp_chunk_positions`).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from lightning_moe.models.transformer import Attention

__all__ = ["enable_context_parallel"]


def enable_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup | None) -> None:
    """Make every ``Attention`` of ``model`` (our transformer) attend across ``cp_group``
    (``None`` turns it off). Raises ``TypeError`` naming any other attention module (one this
    cannot wrap), and ``ValueError`` when there is no ``Attention`` at all, before changing anything."""
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"enable_context_parallel: cp_group={cp_group!r} must be a torch.distributed ProcessGroup or None.")
    ours: list[nn.Module] = []
    prefixes = tuple(name + "." for name, m in model.named_modules() if isinstance(m, Attention) and name)
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            ours.append(module)
        elif isinstance(module, nn.MultiheadAttention) or "attention" in type(module).__name__.lower():
            if not name.startswith(prefixes):  # (an empty tuple matches nothing)
                raise TypeError(
                    f"enable_context_parallel: module {name or '<root>'!r} ({type(module).__name__}) is attention that "
                    "context parallelism cannot wrap: only lightning_moe.models.transformer.Attention attends across "
                    "the CP group. Use MoETransformer, or run this model with cp=1."
                )
    if not ours:
        raise ValueError(
            f"enable_context_parallel: {type(model).__name__} has no lightning_moe Attention module to make context "
            "parallel; use MoETransformer, or run with cp=1."
        )
    for module in ours:
        module.cp_group = cp_group
