"""Models built from MoE layers, and adapters to other libraries' models."""

from lightning_moe.models.transformer import MoETransformer, TransformerConfig

__all__ = ["MoETransformer", "TransformerConfig"]
