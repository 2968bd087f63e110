"""``saved_bytes``: what autograd keeps for backward while a function runs (unit and dist tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["saved_bytes"]


def saved_bytes(fn: Callable[..., object], *args: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves while ``fn(*args)`` runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())
