"""Lightning strategies: ``FoldedMoEStrategy`` (Trainer) and ``FabricFoldedMoEStrategy`` (Fabric).

Both are :class:`~lightning_moe.strategies._core.FoldedMoECore` (degrees, layout, meshes, sampler
arguments, module preparation) on top of Lightning's ``ModelParallelStrategy`` of their side;
``strategy.device_mesh`` is the dense DeviceMesh and ``strategy.folded_mesh`` both views, readable
once the processes have started. Each concern is a module of plain functions, usable without a
strategy: ``layout`` (checks, layout, mesh views), ``sharding`` (context parallel,
``parallelize_moe_model``), ``materialize`` (meta-device init, expert seeding), ``module_setup``
(those steps in order), ``guards`` (liveness watchdog, non-finite guard), ``clipping``,
``checkpoint_io`` and ``optimizers``.

:func:`register_strategies` adds the name ``"folded_moe"`` to
``lightning.pytorch.strategies.StrategyRegistry`` and ``lightning.fabric.strategies.STRATEGY_REGISTRY``
(idempotent; ``import lightning_moe`` calls it).

The standalone ``pytorch_lightning`` and ``lightning_fabric`` packages keep separate registries and
base classes and are not supported: use the ``lightning`` namespace. If one of them is already
imported, ``"folded_moe"`` is registered there too, as a stub that raises a one-line ``TypeError``
saying so (instead of their generic "invalid strategy name"); they are never imported here, which
keeps ``import lightning_moe`` fast.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from lightning_moe.strategies.fabric import FabricFoldedMoEStrategy
from lightning_moe.strategies.folded_moe import FoldedMoEStrategy

__all__ = ["STRATEGY_NAME", "FabricFoldedMoEStrategy", "FoldedMoEStrategy", "register_strategies"]

STRATEGY_NAME = "folded_moe"
_DESCRIPTION = "MoE parallel folding: TP/CP/DP for attention, ETP/EP/EDP for experts (lightning-moe)"
# standalone package -> (its registry module, registry attribute, what to use instead)
_LEGACY = {
    "pytorch_lightning": ("pytorch_lightning.strategies", "StrategyRegistry", "import lightning.pytorch as pl"),
    "lightning_fabric": ("lightning_fabric.strategies", "STRATEGY_REGISTRY", "from lightning import Fabric"),
}


def _legacy_stub(package: str, fix: str) -> Any:
    def refuse(**_: Any) -> NoReturn:
        raise TypeError(
            f"FoldedMoEStrategy: strategy={STRATEGY_NAME!r} was given to the `{package}` package; lightning-moe "
            f"supports the `lightning` namespace only: use `{fix}`."
        )

    return refuse


def register_strategies() -> None:
    """Register ``"folded_moe"`` in the Trainer and Fabric registries (a no-op the second time)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(STRATEGY_NAME, FoldedMoEStrategy, description=_DESCRIPTION)
    if STRATEGY_NAME not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register(STRATEGY_NAME, FabricFoldedMoEStrategy, description=_DESCRIPTION)
    for package, (module, attr, fix) in _LEGACY.items():
        registry = getattr(sys.modules.get(module), attr, None)
        if registry is not None and STRATEGY_NAME not in registry:
            registry.register(STRATEGY_NAME, _legacy_stub(package, fix), description=f"{_DESCRIPTION} (unsupported)")
