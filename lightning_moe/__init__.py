"""lightning-moe: Megatron-Core-class Mixture-of-Experts training for Lightning and Fabric.

Importing this package registers the ``"folded_moe"`` strategy name with Lightning's Trainer
and Fabric registries (the ``lightning`` namespace; ``pytorch_lightning`` keeps separate
registries and is not supported).
"""

from lightning_moe.config import MoEConfig
from lightning_moe.moe.layer import MoELayer, SharedExpert
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy, register_strategies

register_strategies()

__all__ = ["FabricFoldedMoEStrategy", "FoldedLayout", "FoldedMoEStrategy", "MoEConfig", "MoELayer", "SharedExpert"]
__version__ = "0.1.0"
