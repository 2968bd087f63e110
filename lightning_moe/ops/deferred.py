"""A value or the zero-argument function computing it, resolved where it is first needed.

The layer defers a few small ops (routing weights, row weights, the row → slot map, the router's
per-expert counts) until after the first expert GEMM is launched: before that launch the device
waits idle for the host, so host time there is step time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

__all__ = ["Deferred", "ResolvedOnRead", "TakeOnce", "resolved"]

Deferred: TypeAlias = torch.Tensor | Callable[[], torch.Tensor]


def resolved(value: Deferred) -> torch.Tensor:
    """``value``, or what it computes when it is a deferred computation."""
    return value() if callable(value) else value


class ResolvedOnRead:
    """A class attribute that holds a :data:`Deferred` in the instance's slot ``_<name>``: the first
    read resolves it and keeps the tensor, so it is computed once, where it is first needed."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}"

    def __get__(self, instance: object, owner: type | None = None) -> torch.Tensor:
        if instance is None:
            return self  # type: ignore[return-value]  # the descriptor itself, read on the class
        value = resolved(getattr(instance, self._slot))
        setattr(instance, self._slot, value)
        return value


class TakeOnce:
    """A tensor handed down a chain of calls as a :data:`Deferred`: the first call returns it and
    lets it go, so only the frame that took it keeps it alive (freed after its last use there, not
    when every caller above has returned)."""

    __slots__ = ("_value",)

    def __init__(self, value: torch.Tensor) -> None:
        self._value: torch.Tensor | None = value

    def __call__(self) -> torch.Tensor:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("TakeOnce: the tensor was already taken; hand each reader its own.")
        return value
