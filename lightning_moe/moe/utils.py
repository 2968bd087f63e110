"""Walk a model's MoE layers: find them, set their aux-loss scale, step their expert biases."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from lightning_moe.moe.layer import MoELayer

__all__ = ["find_moe_layers", "set_aux_loss_scale", "update_expert_biases", "reset_global_aux_counts"]


def find_moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    """``(qualified name, layer)`` for every :class:`MoELayer` under ``module``, in order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Scale the aux-loss gradients like the main loss (e.g. ``1 / accumulate_grad_batches``)."""
    for _, layer in find_moe_layers(module):
        layer.aux_loss_scale = scale


def update_expert_biases(module: nn.Module, group: Any = None) -> None:
    """Step every layer's aux-loss-free expert bias; call once per optimizer step."""
    for _, layer in find_moe_layers(module):
        layer.router.update_expert_bias(group)


def reset_global_aux_counts(module: nn.Module) -> None:
    """Start a new step's counts for ``aux_loss='global'``; call once per optimizer step."""
    for _, layer in find_moe_layers(module):
        layer.reset_global_aux_counts()
