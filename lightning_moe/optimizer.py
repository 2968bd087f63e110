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

:class:`OptimizerConfig` is the one typed description of the AdamW optimizer and its schedule that
every LightningModule of this package takes (``optimizer:`` under ``model.init_args`` in YAML);
:func:`build_adamw` and :func:`warmup_cosine` turn it into torch objects.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from lightning_moe.checks import check_float, check_int

__all__ = [
    "OPTIMIZER_IMPLS",
    "OptimizerConfig",
    "OptimizerImpl",
    "adamw_kernel_kwargs",
    "build_adamw",
    "check_betas",
    "check_optimizer_fields",
    "check_optimizer_impl",
    "choose_adamw_impl",
    "optimizer_config_from",
    "unscale_before_step",
    "warmup_cosine",
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


def check_betas(owner: str, betas: Any) -> None:
    """Raise ``ValueError`` unless ``betas`` holds two numbers in ``[0, 1)``."""
    if (
        isinstance(betas, (str, bytes))
        or not hasattr(betas, "__len__")
        or len(betas) != 2
        or not all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{owner}: betas={betas!r} must be two numbers in [0, 1); use e.g. betas=(0.9, 0.95).")


def check_optimizer_fields(owner: str, fields: dict[str, Any]) -> None:
    """The checks of :class:`OptimizerConfig`'s fields present in ``fields``, errors worded for ``owner``."""
    if "learning_rate" in fields:
        check_float(owner, "learning_rate", fields["learning_rate"], fix="use e.g. 3e-3")
    if "weight_decay" in fields:
        check_float(owner, "weight_decay", fields["weight_decay"], fix="use 0 or more, e.g. 0.1")
    if "warmup_steps" in fields:
        check_int(owner, "warmup_steps", fields["warmup_steps"], minimum=0, fix="use 0 (no warm-up) or more")
    if "betas" in fields:
        check_betas(owner, fields["betas"])
    if "optimizer_impl" in fields:
        check_optimizer_impl(fields["optimizer_impl"], owner)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule, checked at construction (torch would refuse at the first step).

    Args:
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to norms, biases and the router's expert bias).
        warmup_steps: linear warm-up steps, then cosine decay to 10 % over ``max_steps``.
        betas: AdamW betas.
        optimizer_impl: AdamW kernels: ``fused`` (one kernel per step and dtype), ``foreach``, or
            ``auto`` = fused when every parameter is on CUDA, else torch's default.
    """

    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer_impl: OptimizerImpl = "auto"

    def __post_init__(self) -> None:
        check_optimizer_fields(type(self).__name__, self.as_dict())
        object.__setattr__(self, "betas", tuple(self.betas))

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what a checkpoint's hyper-parameters store)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The ``LambdaLR`` factor: ``(step+1)/warmup`` during warm-up, then cosine from 1 to 0.1 at ``total``."""

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def build_adamw(
    config: OptimizerConfig, decay: list[torch.Tensor], no_decay: list[torch.Tensor], total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over two groups (``decay`` with ``config.weight_decay``, ``no_decay`` without) and its
    warm-up + cosine schedule over ``total_steps``; the optimizer clips under every precision plugin."""
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=tuple(config.betas),
        **adamw_kernel_kwargs(config.optimizer_impl, decay + no_decay),
    )
    unscale_before_step(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, total_steps))
    return optimizer, scheduler


def optimizer_config_from(
    owner: str, optimizer: OptimizerConfig | dict[str, Any] | None, flat: dict[str, Any]
) -> OptimizerConfig:
    """The module's :class:`OptimizerConfig` from its ``optimizer`` argument and the deprecated flat
    arguments (``learning_rate=...`` etc., ``None`` when not given), checked with ``owner``'s name.

    ``optimizer`` may be a plain dict (a checkpoint's hyper-parameters). Flat arguments map into the
    config with a ``DeprecationWarning``; giving both forms raises ``ValueError``.
    """
    given = {name: value for name, value in flat.items() if value is not None}
    if isinstance(optimizer, dict):
        unknown = sorted(set(optimizer) - set(OptimizerConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"{owner}: optimizer has unknown fields {unknown}; use {sorted(OptimizerConfig.__dataclass_fields__)}."
            )
        check_optimizer_fields(owner, optimizer)
        optimizer = OptimizerConfig(**optimizer)
    if optimizer is not None and not isinstance(optimizer, OptimizerConfig):
        raise TypeError(f"{owner}: optimizer={optimizer!r} must be an OptimizerConfig or a dict of its fields.")
    if not given:
        return optimizer if optimizer is not None else OptimizerConfig()
    if optimizer is not None:
        raise ValueError(
            f"{owner}: {', '.join(f'{k}={v!r}' for k, v in given.items())} given next to optimizer=...; "
            "set them inside optimizer only, e.g. optimizer=OptimizerConfig(learning_rate=...)."
        )
    check_optimizer_fields(owner, given)
    warnings.warn(
        f"{owner}: {', '.join(sorted(given))} as separate arguments are deprecated; pass "
        f"optimizer=OptimizerConfig({', '.join(f'{k}=...' for k in sorted(given))}) (YAML: optimizer: "
        "{learning_rate: ...} under model.init_args).",
        DeprecationWarning,
        stacklevel=4,  # the caller of the module's constructor
    )
    return OptimizerConfig(**given)
