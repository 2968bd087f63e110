"""Context parallelism for a Hugging Face causal LM: its attention computed across the CP group.

Legend: B batch, N query heads, Nk key/value heads, s this rank's positions, D head dim.

Under context parallelism every rank holds load-balanced chunks of each sequence
(``parallel/fold_batch.py``) with their global ``position_ids``; an HF model computes its RoPE from
those ids itself, so only the attention over the keys has to change. :func:`enable_hf_context_parallel`
registers one attention function with transformers' ``AttentionInterface`` under the name
:data:`CP_ATTENTION` and points the model's ``config._attn_implementation`` at it. The model's
attention modules then compute their projections, q/k norms and RoPE as always, and hand
``q [B, N, s, D]``, ``k``/``v [B, Nk, s, D]`` to :func:`~lightning_moe.parallel.context.context_parallel_attention`
over the module's ``cp_group`` (the same math as for ``MoETransformer``): causal by global
position and, for packed rows, within each document. transformers builds no mask for a name it has
no mask function for, so no ``[s, s]`` mask is made either.

The model's forward takes ``position_ids`` (required: this rank's global positions) and, for packed
rows, ``document_ids [B, s]``; a forward pre-hook on the model keeps both for the attention
function (they stay until the next forward, so recomputed attention in the backward sees them)
and passes ``document_ids`` no further. A 2-D ``attention_mask`` (padding) is refused. A pipeline
rank's stages of an HF model (``models/hf_pipeline_stage.py: HFLocalStages``) count as one model
whose pre-hook sits on each stage, the module the pipeline schedule calls with the ids.

Families: :data:`CP_ATTENTION_CLASSES` (checked one by one against one process in
``tests/dist/test_dist_hf_context.py``); every other attention class is refused with the reason
(:data:`CP_REFUSED`, or "not known"), and so are sliding-window layers and attention dropout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_moe.parallel.context import context_parallel_attention
from lightning_moe.parallel.pipeline_stage import LocalStages
from lightning_moe.parallel.tp_plans import is_attention_like

__all__ = [
    "CP_ATTENTION",
    "CP_ATTENTION_CLASSES",
    "CP_REFUSED",
    "enable_hf_context_parallel",
    "hf_attention_modules",
    "uses_hf_context_parallel",
]

CP_ATTENTION = "lightning_moe_context_parallel"

# attention classes whose forward hands q/k/v after RoPE to transformers' attention interface,
# with no term the causal softmax over all keys would miss
CP_ATTENTION_CLASSES = (
    "Qwen3MoeAttention", "Qwen2MoeAttention", "MixtralAttention", "OlmoeAttention", "Glm4MoeAttention",
    "Dots1Attention", "Ernie4_5_MoeAttention", "GraniteMoeAttention", "HunYuanMoEV1Attention",
    "DeepseekV2Attention", "DeepseekV3Attention", "Qwen3NextAttention", "Qwen3_5MoeAttention", "MiniMaxAttention",
)  # fmt: skip
_SLIDING = "sliding-window layers"
CP_REFUSED: dict[str, str] = {
    "GptOssAttention": f"its attention adds per-head sinks to the softmax and it has {_SLIDING}",
    "Llama4TextAttention": "its chunked local-attention layers and no-RoPE layers with attention temperature "
    "tuning are not the causal attention over all keys",
    "Qwen3NextGatedDeltaNet": "it is linear attention (a recurrent state along the sequence)",
    "Qwen3_5MoeGatedDeltaNet": "it is linear attention (a recurrent state along the sequence)",
    "MiniMaxLightningAttention": "it is linear attention (a recurrent state along the sequence)",
}


class _SequenceIds:
    """This rank's ``position_ids`` and ``document_ids`` of the latest forward, for the attention."""

    def __init__(self) -> None:
        self.position_ids: torch.Tensor | None = None
        self.document_ids: torch.Tensor | None = None


def _class_names(module: nn.Module) -> list[str]:
    return [cls.__name__ for cls in type(module).__mro__]


def hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention-like module of an HF model under ``model`` (``[]`` when it holds none)."""
    if not any(_is_hf_model(m) for m in model.modules()):
        return []
    return [(n, m) for n, m in model.named_modules() if is_attention_like(m)]


def _is_hf_model(m: nn.Module) -> bool:
    whole = hasattr(getattr(m, "config", None), "_attn_implementation") and hasattr(m, "get_input_embeddings")
    return whole or bool(_stage_views(m))


def _stage_views(m: nn.Module) -> list[nn.Module]:
    """The stages of a pipeline rank's stages of an HF model (``HFLocalStages``), ``[]`` for any other module."""
    if not isinstance(m, LocalStages):
        return []
    return [view for _, view in m.stages if hasattr(getattr(view, "config", None), "_attn_implementation")]


def _config_of(root: nn.Module) -> Any:
    """The HF config of a model, or of a rank's pipeline stages (shared by every stage)."""
    views = _stage_views(root)
    return views[0].config if views else root.config


def _hf_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost HF models under ``model`` (a causal LM, not its inner decoder model)."""
    roots: list[nn.Module] = []
    inner: set[int] = set()
    for m in model.modules():
        if _is_hf_model(m) and id(m) not in inner:
            roots.append(m)
            inner.update(id(sub) for sub in m.modules())
    return roots


def _check_attention(name: str, m: nn.Module) -> None:
    where = f"{name!r} ({type(m).__name__})"
    names = _class_names(m)
    if not any(c in CP_ATTENTION_CLASSES for c in names):
        reason = next((CP_REFUSED[c] for c in names if c in CP_REFUSED), None)
        raise TypeError(
            f"enable_context_parallel: module {where} is attention that context parallelism cannot wrap: "
            f"{reason or 'no context-parallel support is known for this attention class'} (supported HF "
            f"attention: {', '.join(CP_ATTENTION_CLASSES)}). Run this model with cp=1."
        )
    window = getattr(m, "sliding_window", None)
    if window:
        raise ValueError(
            f"enable_context_parallel: {where} has sliding_window={window}; context parallelism computes causal "
            "attention over all keys. Turn the window off in the HF config (sliding_window=None, "
            "use_sliding_window=False) or run with cp=1."
        )
    dropout = float(getattr(m, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ValueError(
            f"enable_context_parallel: {where} has attention_dropout={dropout}; context-parallel attention has no "
            "dropout. Set attention_dropout=0.0 in the HF config or run with cp=1."
        )


def enable_hf_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup | None) -> None:
    """Make the attention of every HF model under ``model`` attend across ``cp_group`` (module doc).

    ``cp_group=None`` checks the attention only and turns a previous call's change back. Raises
    ``TypeError`` naming an attention class it cannot wrap and ``ValueError`` for a sliding window
    or attention dropout, before changing anything.
    """
    attention = hf_attention_modules(model)
    if not attention:
        raise ValueError(f"enable_context_parallel: {type(model).__name__} holds no Hugging Face attention module.")
    for name, m in attention:
        _check_attention(name, m)
    for root in _hf_roots(model):
        _restore(root)
        if cp_group is None:
            continue
        _register_attention()
        ids = _SequenceIds()
        for m in root.modules():
            if is_attention_like(m):
                m.cp_group, m._lm_sequence_ids = cp_group, ids
        config = _config_of(root)
        callers = _stage_views(root) or [root]  # the modules called with the ids
        hooks = [c.register_forward_pre_hook(_take_ids_hook(ids), with_kwargs=True) for c in callers]
        root._lm_context_parallel = (config._attn_implementation, hooks)
        config._attn_implementation = CP_ATTENTION


def uses_hf_context_parallel(model: nn.Module) -> bool:
    """True when :func:`enable_hf_context_parallel` gave an HF model under ``model`` a CP group."""
    return any(getattr(m, "_lm_context_parallel", None) is not None for m in model.modules())


def _restore(root: nn.Module) -> None:
    state = root.__dict__.pop("_lm_context_parallel", None)
    if state is None:
        return
    implementation, hooks = state
    for hook in hooks:
        hook.remove()
    _config_of(root)._attn_implementation = implementation
    for m in root.modules():
        if is_attention_like(m):
            m.cp_group = None
            m.__dict__.pop("_lm_sequence_ids", None)


def _take_ids_hook(ids: _SequenceIds) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        documents = kwargs.pop("document_ids", None)
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError(
                f"{type(module).__name__}: under context parallelism pass position_ids, the global positions of this "
                "rank's shard (lightning_moe.parallel.context.cp_chunk_positions, or the documents' positions "
                "sharded the same way)."
            )
        mask = kwargs.get("attention_mask")
        if mask is not None:
            raise ValueError(
                f"{type(module).__name__}: attention_mask of shape {tuple(mask.shape)} is not supported under context "
                "parallelism; pass document_ids [B, s] for packed rows and leave attention_mask=None."
            )
        ids.position_ids, ids.document_ids = positions, documents
        return args, kwargs

    return hook


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _context_parallel_attention)


def _context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``q [B, N, s, D]``, ``k``/``v [B, Nk, s, D]``
    -> ``([B, s, N, Dv], None)``."""
    ids: _SequenceIds | None = getattr(module, "_lm_sequence_ids", None)
    if ids is None or ids.position_ids is None:
        raise RuntimeError(
            f"{type(module).__name__}: context-parallel attention ran without the model's position_ids; call the "
            "model itself (its forward pre-hook keeps them), not the attention module alone."
        )
    if dropout or sliding_window:
        raise ValueError(
            f"{type(module).__name__}: context-parallel attention got dropout={dropout}, sliding_window={sliding_window}; "
            "it supports neither. Set attention_dropout=0.0 and no sliding window, or run with cp=1."
        )
    B, s = query.shape[0], query.shape[2]
    positions = ids.position_ids
    if positions.dim() == 2 and positions.shape[0] == 1 and B != 1:
        positions = positions[0]
    out = context_parallel_attention(query, key, value, positions, module.cp_group, ids.document_ids, scale=scaling)
    return out.transpose(1, 2).contiguous(), None
