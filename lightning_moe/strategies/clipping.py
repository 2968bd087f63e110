"""Gradient clipping over DTensors on both meshes (``parallel/grad.py``), for the strategies.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails when DTensors live
on two meshes (dense and expert). :func:`mesh_aware_clip_norm` / :func:`mesh_aware_clip_value` clip
a module's gradients over both; :func:`install_mesh_aware_clipping` routes a Trainer precision
plugin's ``gradient_clip_val`` to them (the plugin has no hook for it, so its two clipping methods
are replaced on this plugin instance; the plugin still unscales first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_moe.parallel.grad import clip_grad_norm_, clip_grad_value_

__all__ = ["install_mesh_aware_clipping", "mesh_aware_clip_norm", "mesh_aware_clip_value"]


def mesh_aware_clip_norm(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, pp_group: Any = None
) -> torch.Tensor:
    """Clip ``module``'s gradients to a total norm over both meshes (and over the pipeline stages
    with ``pp_group``); returns the norm before clipping."""
    return clip_grad_norm_(module.parameters(), float(max_norm), float(norm_type), error_if_nonfinite, pp_group)


def mesh_aware_clip_value(module: nn.Module, clip_val: float) -> None:
    """Clamp ``module``'s gradients to ``[-clip_val, clip_val]`` (DTensors on either mesh)."""
    clip_grad_value_(module.parameters(), float(clip_val))


def install_mesh_aware_clipping(plugin: Any, model: nn.Module, pp_group: Any = None) -> None:
    """Give the Trainer precision ``plugin`` mesh-aware ``clip_grad_by_norm``/``clip_grad_by_value`` for
    ``model`` (the norm combined over the pipeline stages with ``pp_group``)."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        mesh_aware_clip_norm(model, clip_val, pp_group=pp_group)

    def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
        mesh_aware_clip_value(model, clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin.clip_grad_by_value = clip_grad_by_value
