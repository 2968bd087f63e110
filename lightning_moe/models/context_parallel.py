"""Context parallelism wired into the model: every ``Attention`` of it attends across the CP group.

The sharding, the collectives and the attention math across the group are the parallel layer's
(:mod:`lightning_moe.parallel.context`); this is the model's own step that hands the group to its
attention modules: ours (``models/transformer.py: Attention``), or a Hugging Face model's
(``models/hf_context_parallel.py``: its attention classes listed there, through transformers'
attention interface). The strategies call :func:`enable_context_parallel` on the module they shard
when ``cp > 1``; after it the model's forward takes this rank's shard of every sequence, with
``position_ids_BS`` its global positions (:func:`~lightning_moe.parallel.context.cp_chunk_positions`).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from lightning_moe.models.hf_context_parallel import CP_ATTENTION_CLASSES, enable_hf_context_parallel, hf_attention_modules
from lightning_moe.models.transformer import Attention

__all__ = ["enable_context_parallel"]


def enable_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup | None) -> None:
    """Make every ``Attention`` of ``model`` (our transformer), or every attention of the Hugging Face
    model it holds, attend across ``cp_group`` (``None`` turns it off). Raises ``TypeError`` naming
    any other attention module (one this cannot wrap), and ``ValueError`` when there is no attention
    at all, before changing anything."""
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"enable_context_parallel: cp_group={cp_group!r} must be a torch.distributed ProcessGroup or None.")
    if not any(isinstance(m, Attention) for m in model.modules()) and hf_attention_modules(model):
        enable_hf_context_parallel(model, cp_group)
        return
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
                    f"the CP group, or a Hugging Face model's {', '.join(CP_ATTENTION_CLASSES)}. Use one of those, or "
                    "run this model with cp=1."
                )
    if not ours:
        raise ValueError(
            f"enable_context_parallel: {type(model).__name__} has no lightning_moe Attention module (nor a Hugging "
            "Face model's attention) to make context parallel; use MoETransformer or a supported HF model, or run "
            "with cp=1."
        )
    for module in ours:
        module.cp_group = cp_group
