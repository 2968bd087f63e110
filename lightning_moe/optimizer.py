"""AdamW kernels chosen so that gradient clipping and every precision plugin agree with them.

torch's fused AdamW marks itself ``_step_supports_amp_scaling``: under a ``GradScaler`` it takes the
scale and the inf flag into its kernel and unscales the gradients there, inside ``step``. Lightning's
precision plugins read that mark as "this optimizer unscales by itself" and then refuse gradient
clipping (``bf16-mixed`` included, which has no scaler at all), and Fabric's ``clip_gradients``
raises ``NotImplementedError``: clipping the still-scaled gradients would clip at the wrong norm.

:func:`unscale_before_step` takes the mark off one optimizer instance. The fused kernel still runs
(the speed is the kernel's, the in-kernel unscale saves one pass over the gradients at most); a
``GradScaler`` then unscales the gradients before clipping and skips the step on inf, as it does
for any optimizer. So one rule holds for every precision (``32-true``, ``bf16-mixed``,
``bf16-true``, ``16-mixed``) and every strategy: gradients are unscaled when clipping reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch

__all__ = [
    "OPTIMIZER_IMPLS",
    "OptimizerImpl",
    "adamw_kernel_kwargs",
    "check_optimizer_impl",
    "choose_adamw_impl",
    "unscale_before_step",
]

OptimizerImpl = Literal["auto", "fused", "foreach"]
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)


def check_optimizer_impl(impl: str, owner: str) -> None:
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"{owner}: optimizer_impl={impl!r} is unknown; choose one of {OPTIMIZER_IMPLS}.")


def choose_adamw_impl(impl: str, device_types: Iterable[str]) -> str:
    """``impl`` with ``auto`` resolved: ``fused`` when every parameter lives on CUDA, else torch's
    default (``"default"``: foreach where torch picks it)."""
    if impl != "auto":
        return impl
    types = set(device_types)
    return "fused" if types == {"cuda"} else "default"


def adamw_kernel_kwargs(impl: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """The AdamW keyword for ``impl`` over ``params`` (``auto`` fuses when every parameter is on CUDA)."""
    chosen = choose_adamw_impl(impl, (p.device.type for p in params))
    return {"fused": True} if chosen == "fused" else {"foreach": True} if chosen == "foreach" else {}


def unscale_before_step(optimizer: Any) -> Any:
    """Let clipping and a ``GradScaler`` see ``optimizer`` as one that needs unscaled gradients.

    Applies to any optimizer (fused AdamW/Adam/SGD set the mark); returns it for chaining. A
    ``LightningOptimizer`` wrapper is unwrapped first.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    if getattr(inner, "_step_supports_amp_scaling", False):
        inner._step_supports_amp_scaling = False
    return optimizer
