"""Shared by the callbacks: find the MoE layers of a LightningModule, or refuse it clearly."""

from __future__ import annotations

from torch import nn

from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import find_moe_layers

__all__ = ["require_moe_layers"]


def require_moe_layers(owner: str, module: nn.Module) -> list[tuple[str, MoELayer]]:
    """``(qualified name, layer)`` pairs of ``module``; raise naming ``owner`` when there are none.

    A callback calls this in ``setup``: a model without :class:`MoELayer` (e.g. a Hugging Face
    model whose MoE blocks were never swapped) is a configuration mistake, not a silent no-op.
    """
    layers = find_moe_layers(module)
    if not layers:
        raise ValueError(
            f"{owner}: {type(module).__name__} holds no lightning_moe MoELayer, so there is nothing to "
            "act on; build the model from lightning_moe.MoELayer, or call "
            "lightning_moe.models.hf.swap_moe_blocks(model) on a Hugging Face MoE model before fitting."
        )
    return layers
