"""Attention masks and position ids that keep a Hugging Face causal LM within each packed document.

Legend: B batch, S sequence; document ids as in ``lightning_moe.data.packing``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["packed_attention_mask", "packed_forward_kwargs"]

# Attention backends that honour a 4-D mask (others, e.g. flash_attention_2, ignore or refuse it).
_MASKED_ATTENTION = ("sdpa", "eager")
_LAYER_KINDS = ("full_attention", "sliding_attention")


def packed_attention_mask(
    document_ids_BS: torch.Tensor, *, additive_dtype: torch.dtype | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """The 4-D attention mask ``[B, 1, S, S]`` of packed rows: causal, within one document only.

    Query ``i`` sees key ``j`` iff ``j <= i``, ``document_ids[j] == document_ids[i]`` and, with a
    ``sliding_window``, ``i - j < sliding_window`` (transformers' window rule). Boolean (``True``
    = attend; what sdpa takes) unless ``additive_dtype`` is given: then 0 where attended and that
    dtype's minimum elsewhere (what the eager attention adds to its scores). transformers passes a
    4-D mask through unchanged, so it replaces the causal mask the model would build.
    """
    B, S = document_ids_BS.shape
    i_S1 = torch.arange(S, device=document_ids_BS.device)[:, None]
    j_1S = torch.arange(S, device=document_ids_BS.device)[None, :]
    allowed_SS = j_1S <= i_S1
    if sliding_window is not None:
        allowed_SS = allowed_SS & (i_S1 - j_1S < sliding_window)
    same_BSS = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    mask_B1SS = (same_BSS & allowed_SS)[:, None]
    if additive_dtype is None:
        return mask_B1SS
    blocked = torch.finfo(additive_dtype).min
    return torch.zeros(mask_B1SS.shape, dtype=additive_dtype, device=mask_B1SS.device).masked_fill_(~mask_B1SS, blocked)


def _attention_kinds(config: Any) -> tuple[set[str], int | None]:
    """The layer kinds (``full_attention``/``sliding_attention``) of an HF config, and its window."""
    window = getattr(config, "sliding_window", None) or None  # qwen2_moe stores 0 for "off"
    layer_types = getattr(config, "layer_types", None)
    kinds = set(layer_types) if layer_types else {"sliding_attention" if window else "full_attention"}
    unknown = kinds - set(_LAYER_KINDS)
    if unknown:
        raise ValueError(
            f"packed_forward_kwargs: layer_types {sorted(unknown)} of {type(config).__name__} have no packed mask here "
            f"(known: {list(_LAYER_KINDS)}); run this model on unpacked rows (packing='none')."
        )
    if "sliding_attention" in kinds and window is None:
        raise ValueError(
            f"packed_forward_kwargs: {type(config).__name__} has sliding_attention layers but sliding_window="
            f"{getattr(config, 'sliding_window', None)!r}; set sliding_window in the HF config."
        )
    return kinds, window


def packed_forward_kwargs(
    model: nn.Module, input_ids: torch.Tensor, document_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> dict[str, Any]:
    """``attention_mask`` and ``position_ids`` that make an HF causal LM attend within documents only.

    ``document_ids`` ``[B, S]`` like ``input_ids`` (non-decreasing along each row; checked with
    ``check_packed_batch``, as are ``position_ids``); ``position_ids`` defaults to the
    position within each document (``position_ids_from_document_ids``). The mask is
    :func:`packed_attention_mask`: boolean for ``attn_implementation="sdpa"``, additive in the
    model's dtype for ``"eager"``; a model mixing full and sliding-window layers (``layer_types``)
    gets one mask per kind, as its forward accepts. Other attention backends raise ``ValueError``.
    (Given restarting position ids and no mask, transformers finds the boundaries from the position
    ids itself; the explicit mask follows the document ids, which are checked, instead.)
    """
    from lightning_moe.data.packing import check_packed_batch, position_ids_from_document_ids

    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _MASKED_ATTENTION:
        raise ValueError(
            f"packed_forward_kwargs: attn_implementation={impl!r} does not take the 4-D mask that keeps attention "
            f"within a document; build the model with attn_implementation in {list(_MASKED_ATTENTION)}."
        )
    if position_ids is None:
        position_ids = position_ids_from_document_ids(document_ids)
    check_packed_batch({"input_ids": input_ids, "document_ids": document_ids, "position_ids": position_ids})
    kinds, window = _attention_kinds(config)
    dtype = None
    if impl == "eager":
        weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    masks = {
        kind: packed_attention_mask(document_ids, additive_dtype=dtype,
                                    sliding_window=window if kind == "sliding_attention" else None)
        for kind in sorted(kinds)
    }  # fmt: skip
    mask: Any = masks if len(masks) > 1 else next(iter(masks.values()))
    return {"attention_mask": mask, "position_ids": position_ids}
