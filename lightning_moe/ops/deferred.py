"""A value or the zero-argument function computing it, resolved where it is first needed.

The layer defers a few small ops (routing weights, row weights, the row → slot map, the router's
per-expert counts) until after the first expert GEMM is launched: before that launch the device
waits idle for the host, so host time there is step time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

__all__ = ["Deferred", "resolved"]

Deferred: TypeAlias = torch.Tensor | Callable[[], torch.Tensor]


def resolved(value: Deferred) -> torch.Tensor:
    """``value``, or what it computes when it is a deferred computation."""
    return value() if callable(value) else value
