"""Optimizers handed to a folded strategy before its module was sharded (``fabric.setup(model, optimizer)``).

TP and FSDP2 replace every parameter by a DTensor parameter of the same name, so an optimizer made
before sharding would step the old tensors. :func:`check_unstepped_optimizers` refuses one that
has state or holds foreign parameters (before anything is sharded); :func:`repoint_optimizers`
rebuilds the parameter groups by name over the sharded module, and every optimizer clips under
every precision plugin (``lightning_moe.optimizer.unscale_before_step``).
"""

from __future__ import annotations

import torch.nn as nn
from torch.optim import Optimizer

from lightning_moe.optimizer import unscale_before_step

__all__ = ["check_unstepped_optimizers", "parameter_names", "repoint_optimizers"]


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` over ``module``'s parameters."""
    return {id(p): n for n, p in module.named_parameters()}


def check_unstepped_optimizers(owner: str, optimizers: list[Optimizer], names: dict[int, str]) -> None:
    """``ValueError`` for an optimizer that has stepped or holds parameters not in ``names``."""
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                f"{owner}: {type(optimizer).__name__} already has state for {len(optimizer.state)} parameters; "
                "pass an optimizer that has not stepped, or call fabric.setup(model) first and build the "
                "optimizer from the returned model's parameters."
            )
        unknown = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
        if unknown:
            raise ValueError(
                f"{owner}: {type(optimizer).__name__} holds {unknown} parameters that are not the model's; "
                "build it from model.parameters()."
            )


def repoint_optimizers(optimizers: list[Optimizer], names: dict[int, str], sharded: nn.Module) -> None:
    """Point every parameter group at ``sharded``'s parameter of the same name (``names`` is the
    unsharded module's :func:`parameter_names`)."""
    params = dict(sharded.named_parameters())
    for optimizer in optimizers:
        unscale_before_step(optimizer)  # fused optimizers clip under every precision plugin
        for group in optimizer.param_groups:
            group["params"] = [params[names[id(p)]] for p in group["params"]]
