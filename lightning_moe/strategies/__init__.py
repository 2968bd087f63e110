"""Lightning strategies: ``FoldedMoEStrategy`` (Trainer) and ``FabricFoldedMoEStrategy`` (Fabric).

:func:`register_strategies` adds the name ``"folded_moe"`` to
``lightning.pytorch.strategies.StrategyRegistry`` and ``lightning.fabric.strategies.STRATEGY_REGISTRY``
(idempotent; ``import lightning_moe`` calls it). The ``pytorch_lightning`` package keeps separate
registries and classes and is not supported: use the ``lightning`` namespace.
"""

from __future__ import annotations

from lightning_moe.strategies.fabric import FabricFoldedMoEStrategy
from lightning_moe.strategies.folded_moe import FoldedMoEStrategy

__all__ = ["FabricFoldedMoEStrategy", "FoldedMoEStrategy", "STRATEGY_NAME", "register_strategies"]

STRATEGY_NAME = "folded_moe"


def register_strategies() -> None:
    """Register ``"folded_moe"`` in the Trainer and Fabric registries (a no-op the second time)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    description = "MoE parallel folding: TP/CP/DP for attention, ETP/EP/EDP for experts (lightning-moe)"
    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(STRATEGY_NAME, FoldedMoEStrategy, description=description)
    if STRATEGY_NAME not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register(STRATEGY_NAME, FabricFoldedMoEStrategy, description=description)
