"""Distributed concerns: rank algebra, meshes, sharding. No Lightning imports."""

from lightning_moe.parallel.layout import AXIS_NAMES, FoldedLayout

__all__ = ["AXIS_NAMES", "FoldedLayout"]
