"""Distributed checkpoints of folded models: what is stored, and how to read it back whole.

Lightning's ModelParallelStrategy saves with DCP (``torch.distributed.checkpoint``): every rank
writes the boxes of the DTensors it owns, and a load reads whichever boxes its new sharding
needs. That is what makes a checkpoint reshardable (save at EP=4, load at EP=2 or EP=1) — *if*
every parameter is a DTensor that knows its global shape. ``parallelize.py`` guarantees it for
the experts: ``w13 [E, H, 2F]`` and ``w2 [E, F, H]`` are DTensors over ``(edp, ep[, etp])``
(FSDP ``Shard(1)`` on edp, ``Shard(0)`` on ep). A plain tensor of local experts stored under
the same name by every EP rank would make DCP keep one rank's copy and drop the other experts
silently; :func:`stored_expert_ids` reads a checkpoint's metadata to prove that every expert id
is there.

With ETP > 1, ``w13``'s column blocks are ``[gate_j | up_j]`` (see ``parallelize.unblock_w13``):
a checkpoint loads back at the same ETP degree with any EP/EDP/TP; changing ETP needs a
conversion that is not written yet.

Collectives: :func:`gather_full_state` calls ``DTensor.full_tensor`` per parameter
(all-gather over the parameter's mesh), so every rank must call it, in the same order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.parallel.parallelize import unblock_w13

__all__ = ["gather_full_state", "stored_expert_ids"]


def gather_full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor in the one-process layout (``w13`` as ``[gate | up]``).

    Collective over each parameter's mesh; returns the same dict on every rank.
    """
    etp_of: dict[str, int] = {}
    for name, m in module.named_modules():
        if isinstance(m, GroupedExperts):
            etp_of[f"{name}.w13" if name else "w13"] = getattr(m, "etp", 1)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        full = full.detach().cpu().clone()
        if name in etp_of:
            full = unblock_w13(full, etp_of[name])
        out[name] = full
    return out


def stored_expert_ids(checkpoint_dir: str | Path, key: str) -> list[int]:
    """Expert ids (rows of dim 0) of ``key`` that a DCP checkpoint folder actually holds.

    Reads only the metadata: the union of the stored chunks' dim-0 ranges.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint_dir)).read_metadata()
    if key not in metadata.state_dict_metadata:
        known = [k for k in metadata.state_dict_metadata if k.endswith(key.rsplit(".", 1)[-1])][:5]
        raise KeyError(f"stored_expert_ids: key={key!r} is not in {checkpoint_dir}; similar keys: {known}.")
    entry = metadata.state_dict_metadata[key]
    ids: set[int] = set()
    for chunk in getattr(entry, "chunks", []):
        start, size = chunk.offsets[0], chunk.sizes[0]
        ids.update(range(start, start + size))
    return sorted(ids)
