"""The MoE layer: pure PyTorch (no Lightning imports)."""

from lightning_moe.moe.dispatch import DispatchedTokens, Dispatcher, DispatcherCapabilities, LocalDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.layer import MoELayer, SharedExpert
from lightning_moe.moe.router import RouterOutput, TopKRouter
from lightning_moe.moe.utils import find_moe_layers, reset_global_aux_counts, set_aux_loss_scale, update_expert_biases

__all__ = [
    "DispatchedTokens",
    "Dispatcher",
    "DispatcherCapabilities",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "RouterOutput",
    "SharedExpert",
    "TopKRouter",
    "find_moe_layers",
    "reset_global_aux_counts",
    "set_aux_loss_scale",
    "update_expert_biases",
]
