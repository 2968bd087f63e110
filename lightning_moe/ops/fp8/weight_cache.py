"""Expert weights quantized once per optimizer step, for every micro-batch and both GEMMs that read them.

Legend: E experts, K a projection's input width, N its output width.

A weight ``w_EKN`` feeds two FP8 GEMMs: the forward contracts over K (``fprop``), the data
gradient over N (``dgrad``: ``w^T [E, N, K]``). Each operand is quantized from the master weight
(``quantize(..., reduce_dim=-2)``: the data comes out contracted-dim-major, the layout every FP8
backend reads) and, with ``Fp8Config(cache_weights=True)``, kept on the weight tensor until the
weight changes, so that the backward and every further micro-batch of the same optimizer step read
the same FP8 bytes instead of quantizing again.

An entry is used only while all of these hold, so a stale FP8 copy is never read:

* the same tensor object (the entry lives on it; a view is keyed on its base and its own offset,
  shape and strides);
* the same ``_version`` (every in-place update of the weight, an optimizer's included, bumps it);
* the same optimizer-step count: a global ``torch.optim`` step post-hook, registered on first use,
  counts the steps of every optimizer (for updates that bypass the version counter).

Memory: one FP8 copy per operand (about one byte per expert parameter for each of ``fprop`` and
``dgrad``) stays alive between steps; ``cache_weights=False`` quantizes in every call instead and
keeps nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_moe.ops.fp8.quantize import Fp8Tensor, quantize

__all__ = ["WeightUse", "optimizer_steps", "quantized_weight"]

WeightUse = Literal["fprop", "dgrad"]

_ATTR = "_lightning_moe_fp8_weights"
_steps = 0
_hook_registered = False


def _count_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:  # noqa: ARG001
    global _steps
    _steps += 1


def optimizer_steps() -> int:
    """Optimizer steps seen since the cache was first used (any ``torch.optim`` optimizer)."""
    global _hook_registered
    if not _hook_registered:
        register_optimizer_step_post_hook(_count_step)
        _hook_registered = True
    return _steps


def _quantize(w_EKN: torch.Tensor, use: WeightUse, recipe: str, pow2_scales: bool) -> Fp8Tensor:
    src = w_EKN if use == "fprop" else w_EKN.transpose(1, 2)
    return quantize(src.detach(), recipe, "e4m3", reduce_dim=-2, pow2_scales=pow2_scales)  # type: ignore[arg-type]


def _key(w: torch.Tensor, use: WeightUse, recipe: str, pow2_scales: bool) -> tuple:
    return (use, recipe, pow2_scales, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype)


def quantized_weight(
    w_EKN: torch.Tensor, use: WeightUse, recipe: str, pow2_scales: bool, cache: bool
) -> Fp8Tensor:
    """The e4m3 operand of ``w_EKN`` for ``use``: ``[E, K, N]`` contracted over K (``fprop``) or
    ``[E, N, K]`` contracted over N (``dgrad``), in the recipe's weight units (blockwise: 128 x 128).

    ``cache``: reuse the copy made from this weight since it last changed (see the module doc)."""
    if use not in ("fprop", "dgrad"):
        raise ValueError(f"quantized_weight: use={use!r} is not one of ('fprop', 'dgrad')")
    if not cache:
        return _quantize(w_EKN, use, recipe, pow2_scales)
    owner = w_EKN._base if w_EKN._base is not None else w_EKN
    entries: dict = owner.__dict__.setdefault(_ATTR, {})
    key = _key(w_EKN, use, recipe, pow2_scales)
    stamp = (w_EKN._version, optimizer_steps())
    hit = entries.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    entries.pop(key, None)  # the stale copy goes before the new one is made (peak memory)
    q = _quantize(w_EKN, use, recipe, pow2_scales)
    entries[key] = (stamp, q)
    return q
