"""Pipeline stages of a Hugging Face decoder-only causal LM, cut from its own modules.

Legend: B batch, S sequence, H hidden, V vocabulary.

A transformers ``*ForCausalLM`` (``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb``, ``lm_head``; its MoE blocks usually swapped by
:func:`~lightning_moe.models.hf.swap_moe_blocks`) is cut without copying: :func:`build_hf_stage`
returns an :class:`HFTransformerStage`, a :class:`~lightning_moe.parallel.pipeline_stage.TransformerStage`
holding the model's embedding (first stage), its decoder layers ``layers`` in a ``ModuleDict`` keyed
by the global layer index, and the final norm and head (last stage), with the same forward
contract: the first stage takes token ids ``[B, S]``, the others hidden states ``[B, S, H]``; the
last returns logits ``[B, S, V]``. :func:`cut_hf_rank_stages` gathers a pipeline rank's stages into
an :class:`HFLocalStages`.

Every stage runs what the HF decoder runs around its layers: the positions, the model's own rotary
embedding (``rotary_emb``, shared by every stage; no parameters) at those positions, and the
attention mask from transformers' own helpers (``create_causal_mask``, or
``create_sliding_window_causal_mask`` for sliding-window layers, per layer type where the config
has ``layer_types``), each decoder layer then called as the HF decoder calls it
(``layer(h, attention_mask=, position_ids=, position_embeddings=(cos, sin))``). Caches and padding
masks are not carried between stages.

``forward(x, position_ids=None, document_ids=None)`` takes the per-token ids ``[B, S]`` as keyword
arguments, which the pipeline schedule splits into micro-batches and hands to every stage, and
builds from them what the whole model builds from them at ``pp = 1``:

- positions ``0..S-1`` when neither is given; ``position_ids`` when given; else the positions
  restarting with each document of ``document_ids``;
- packed rows (``document_ids``): the 4-D mask that keeps attention within each document, the
  one ``HFMoELanguageModel.forward`` gives the model (``models/hf_packed.py: packed_forward_kwargs``);
- context parallel (``models/hf_context_parallel.py``, enabled on the rank's
  :class:`HFLocalStages`): ``position_ids`` are this rank's global positions, a forward pre-hook on
  each stage hands them and ``document_ids`` to the context-parallel attention, and transformers
  builds no mask for it;
- sequence parallel (``parallel/parallelize.py``): the hidden states hold ``S/tp`` positions (the
  first stage's embedding output is scattered along the sequence, the last stage's head input
  gathered) while the ids, the rotary tables and the mask cover all ``S`` positions; the attention
  and dense MLPs gather their input along the sequence.

Parameter names follow :class:`TransformerStage` (``embed.weight``, ``layers.3.self_attn.q_proj.weight``,
``norm.weight``, ``lm_head.weight``); :func:`hf_parameter_name` maps them to the HF model's
(``model.embed_tokens.weight``, ``model.layers.3.self_attn.q_proj.weight``, ``model.norm.weight``,
``lm_head.weight``).

Only families whose decoder forward is exactly that recipe are cut (:data:`MASK_RULES`, checked
against the installed transformers; :data:`MASKS_WITHOUT_POSITIONS`: those whose decoder builds
its masks without the position ids); the others are refused with the reason
(:func:`check_hf_pipeline_model`): tied embeddings, hybrid linear-attention or state-space layers,
vision-language wrappers, scaled embeddings or logits, and families not checked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.data.packing import position_ids_from_document_ids
from lightning_moe.models.hf_packed import packed_forward_kwargs
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.pipeline_stage import LocalStages, TransformerStage, check_stage_range

__all__ = [
    "MASKS_WITHOUT_POSITIONS",
    "MASK_RULES",
    "REFUSED_FAMILIES",
    "HFLocalStages",
    "HFTransformerStage",
    "build_hf_stage",
    "check_hf_pipeline_model",
    "cut_hf_rank_stages",
    "hf_parameter_name",
]

# model_type -> how its decoder builds the attention mask of a plain batch:
#   "causal": always create_causal_mask;
#   "sliding_if_set": create_sliding_window_causal_mask when config.sliding_window is set, else causal;
#   "layer_types": per layer, by config.layer_types ("full_attention" or "sliding_attention").
MASK_RULES: dict[str, str] = {
    "qwen3_moe": "sliding_if_set",
    "mixtral": "sliding_if_set",
    "olmoe": "causal",
    "deepseek_v3": "causal",
    "deepseek_v2": "causal",
    "glm4_moe": "causal",
    "glm4_moe_lite": "causal",
    "ernie4_5_moe": "causal",
    "hunyuan_v1_moe": "causal",
    "minimax_m2": "causal",
    "qwen2_moe": "layer_types",
    "dots1": "layer_types",
    "gpt_oss": "layer_types",
}

# families whose decoder builds its masks without position_ids (positions restarting mid-row then
# mark no packed sequences in the mask, as they do for the other families)
MASKS_WITHOUT_POSITIONS = frozenset({"qwen2_moe", "dots1", "gpt_oss"})

_HYBRID = (
    "its decoder mixes attention with linear-attention or state-space layers, whose per-layer state, "
    "cache and mask inputs the stages do not build"
)
_VISION = (
    "it is a vision-language wrapper: its text decoder takes image features and multimodal positions "
    "the stages do not carry; cut a text-only causal LM"
)
REFUSED_FAMILIES: dict[str, str] = {
    **dict.fromkeys(
        ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "minimax", "kimi_linear", "granitemoehybrid", "jamba",
         "nemotron_h", "lfm2_moe"),
        _HYBRID,
    ),
    **dict.fromkeys(("qwen3_vl_moe", "glm4v_moe", "ernie4_5_vl_moe", "llama4"), _VISION),
    **dict.fromkeys(
        ("granitemoe", "granitemoeshared", "granitemoe_swa"),
        "its decoder scales the embeddings (embedding_multiplier) and its head divides the logits "
        "(logits_scaling) outside the layers, which the stages do not reproduce",
    ),
    "cohere2_moe": "its head multiplies the logits by logit_scale outside lm_head, which the last stage does not",
    "afmoe": "its decoder scales the embeddings by sqrt(hidden_size) (mup_enabled) outside the layers, "
    "which the first stage does not",
}  # fmt: skip

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _refuse(family: str, reason: str) -> ValueError:
    return ValueError(f"build_hf_stage: cannot cut a {family} model into pipeline stages: {reason}.")


def check_hf_pipeline_model(hf_model: nn.Module) -> str:
    """The mask rule of ``hf_model`` (one of :data:`MASK_RULES`' values) if it can be cut into
    stages; ``ValueError`` naming the family and the reason otherwise."""
    config = getattr(hf_model, "config", None)
    family = str(getattr(config, "model_type", type(hf_model).__name__))
    if family in REFUSED_FAMILIES:
        raise _refuse(family, REFUSED_FAMILIES[family])
    if getattr(config, "vision_config", None) is not None:
        raise _refuse(family, _VISION)
    if family not in MASK_RULES:
        raise _refuse(
            family,
            "its decoder forward has not been checked against the recipe the stages reproduce (embedding, "
            f"rotary embedding, causal mask, layers, norm, head); families that can be cut: {sorted(MASK_RULES)}",
        )
    decoder = getattr(hf_model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not isinstance(getattr(hf_model, "lm_head", None), nn.Linear) or not all(
        isinstance(getattr(decoder, p, None), nn.Module) for p in parts
    ):
        raise _refuse(
            family,
            f"{type(hf_model).__name__} is not a decoder-only causal LM with model.embed_tokens, model.layers, "
            "model.norm, model.rotary_emb and lm_head",
        )
    rule = MASK_RULES[family]
    types = getattr(config, "layer_types", None)
    if rule == "layer_types" and (types is None or any(t not in _LAYER_TYPES for t in types)):
        raise _refuse(family, f"its layer_types={types!r} name layers other than {_LAYER_TYPES}")
    tied = hf_model.lm_head.weight is decoder.embed_tokens.weight  # type: ignore[union-attr]
    if tied or getattr(config, "tie_word_embeddings", False):
        raise _refuse(
            family,
            "tie_word_embeddings=True shares the embedding with the head, which sit on different pipeline stages; "
            "build the model with tie_word_embeddings=False",
        )
    return rule


def _rotary_tables(rotary_emb: nn.Module, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF rotary embedding's fp32 ``(cos, sin)`` for positions ``0..seq_len-1``."""
    x = torch.zeros(1, seq_len, 1, device=device)
    return rotary_emb(x, torch.arange(seq_len, device=device).unsqueeze(0))


def _rotary_at(
    rotary_emb: nn.Module, position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF rotary embedding's fp32 ``(cos, sin)`` at ``position_ids_BS``, or at the positions
    restarting with each document of ``document_ids_BS``."""
    positions_BS = _positions(position_ids_BS, document_ids_BS)
    return rotary_emb(torch.zeros(1, 1, 1, device=positions_BS.device), positions_BS)


def _positions(position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None) -> torch.Tensor:
    if position_ids_BS is not None:
        return position_ids_BS
    if document_ids_BS is None:
        raise ValueError("HFTransformerStage: pass position_ids or document_ids for the positions of the tokens.")
    return position_ids_from_document_ids(document_ids_BS)


class _MaskSource:
    """What ``packed_forward_kwargs`` reads of a model: its config, and its embedding's dtype (the
    dtype of the additive mask that eager attention takes)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        self.config = config
        self.weight = torch.empty(0, dtype=dtype)

    def get_input_embeddings(self) -> _MaskSource:
        return self


class HFTransformerStage(TransformerStage):
    """A :class:`TransformerStage` of HF decoder layers: the embedding (first stage), a contiguous
    run of decoder layers, the norm and head (last stage), and the model's rotary embedding."""

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        rotary_emb: nn.Module,
        config: Any,
        mask_rule: str,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ) -> None:
        super().__init__(
            blocks, functools.partial(_rotary_tables, rotary_emb), embed=embed, norm=norm, lm_head=lm_head,
            rope_positions=functools.partial(_rotary_at, rotary_emb),
        )  # fmt: skip
        self.rotary_emb = rotary_emb
        self.config = config
        self.mask_rule = mask_rule

    def _kind(self, index: str) -> str:
        """The mask key of layer ``index``: its layer type under the ``layer_types`` rule, else ``all``."""
        return self.config.layer_types[int(index)] if self.mask_rule == "layer_types" else "all"

    def _sliding(self) -> bool:
        return self.mask_rule == "sliding_if_set" and getattr(self.config, "sliding_window", None) is not None

    def _masks(self, h_BsH: torch.Tensor, position_ids_BS: torch.Tensor) -> dict[str, Any]:
        """The attention mask of each layer type of this stage, as the HF decoder builds it for the
        whole sequence of ``position_ids_BS`` (``h_BsH`` may hold ``S/tp`` of its positions)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        # the helpers read the batch size, the query length, the dtype and the device of the embeddings
        whole_BS0 = h_BsH.new_empty(h_BsH.shape[0], position_ids_BS.shape[-1], 0)
        positions = None if getattr(self.config, "model_type", None) in MASKS_WITHOUT_POSITIONS else position_ids_BS
        kwargs = dict(config=self.config, inputs_embeds=whole_BS0, attention_mask=None, cache=None, position_ids=positions)
        if self.mask_rule == "layer_types":
            makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            return {t: makers[t](**kwargs) for t in {self._kind(i) for i in self.layers}}
        return {"all": (create_sliding_window_causal_mask if self._sliding() else create_causal_mask)(**kwargs)}

    def _packed_masks(
        self, h_BsH: torch.Tensor, position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The positions and the per-layer-type masks that keep attention within each document, as
        ``HFMoELanguageModel.forward`` builds them for the whole model (``packed_forward_kwargs``;
        the document ids stand in for the token ids, of which it checks only the shape)."""
        source = _MaskSource(self.config, h_BsH.dtype)
        packed = packed_forward_kwargs(source, document_ids_BS, document_ids_BS, position_ids_BS)  # type: ignore[arg-type]
        mask = packed["attention_mask"]
        if not isinstance(mask, dict):
            return packed["position_ids"], {self._kind(i): mask for i in self.layers}
        if self.mask_rule != "layer_types":
            mask = {"all": mask["sliding_attention" if self._sliding() else "full_attention"]}
        return packed["position_ids"], mask

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h_BsH = self.embed(x) if self.embed is not None else x  # s = S/tp under sequence parallel
        if document_ids is not None:
            position_ids, masks = self._packed_masks(h_BsH, position_ids, document_ids)
        else:
            if position_ids is None:
                position_ids = torch.arange(h_BsH.shape[1], device=h_BsH.device).unsqueeze(0)
            masks = self._masks(h_BsH, position_ids)
        cos_sin = self.rotary_emb(h_BsH, position_ids)
        for index, layer in self.layers.items():
            out = layer(
                h_BsH, attention_mask=masks[self._kind(index)], position_ids=position_ids, position_embeddings=cos_sin
            )
            h_BsH = out[0] if isinstance(out, tuple) else out
        if self.lm_head is None:
            return h_BsH
        return self.lm_head(self.norm(h_BsH))


def build_hf_stage(hf_model: nn.Module, layers: range, num_layers: int) -> HFTransformerStage:
    """The stage of ``hf_model`` that runs decoder layers ``layers`` (first stage if it starts at 0,
    last if it ends at ``num_layers``). Shares the model's modules; ``ValueError`` for a model
    :func:`check_hf_pipeline_model` refuses or a bad range."""
    rule = check_hf_pipeline_model(hf_model)
    decoder: Any = hf_model.model
    check_stage_range("build_hf_stage", layers, num_layers, len(decoder.layers), "len(hf_model.model.layers)")
    first, last = layers.start == 0, layers.stop == num_layers
    return HFTransformerStage(
        {i: decoder.layers[i] for i in layers},
        decoder.rotary_emb,
        hf_model.config,  # type: ignore[arg-type]
        rule,
        embed=decoder.embed_tokens if first else None,
        norm=decoder.norm if last else None,
        lm_head=hf_model.lm_head if last else None,  # type: ignore[arg-type]
    )


def hf_parameter_name(stage_name: str, decoder: str = "model") -> str:
    """The HF model's name of a stage (or :class:`HFLocalStages`) parameter or buffer:
    ``embed.`` → ``model.embed_tokens.``, ``layers.`` → ``model.layers.``, ``norm.`` → ``model.norm.``,
    ``lm_head.`` unchanged (``decoder`` is the causal LM's attribute holding the decoder)."""
    for ours, theirs in (("embed.", "embed_tokens."), ("layers.", "layers."), ("norm.", "norm.")):
        if stage_name.startswith(ours):
            return f"{decoder}.{theirs}{stage_name[len(ours):]}"
    if stage_name.startswith("lm_head."):
        return stage_name
    raise ValueError(
        f"hf_parameter_name: {stage_name!r} is not a stage name (embed., layers., norm., lm_head.); pass a name "
        "of a stage's named_parameters()."
    )


class HFLocalStages(LocalStages):
    """:class:`LocalStages` of HF stages, also holding the model's rotary embedding (no parameters;
    its non-persistent frequencies move, and materialise, with the stages)."""

    def __init__(self, stages: list[tuple[int, TransformerStage]]) -> None:
        super().__init__(stages)
        self.rotary_emb = getattr(stages[0][1], "rotary_emb", None) if stages else None


def cut_hf_rank_stages(hf_model: nn.Module, ranges: tuple[range, ...], mine: tuple[int, ...]) -> HFLocalStages:
    """The stages ``mine`` (indices into ``ranges``, from ``stage_indices``) of ``hf_model`` as one
    :class:`HFLocalStages`. Each MoE layer is told its index among the whole model's MoE layers
    (``global_moe_index``), so per-expert seeding does not depend on the cut."""
    check_hf_pipeline_model(hf_model)
    decoder: Any = hf_model.model
    ordinal = 0
    for layer in decoder.layers:
        for m in layer.modules():
            if isinstance(m, MoELayer):
                m.global_moe_index = ordinal
                ordinal += 1
    num_layers = len(decoder.layers)
    return HFLocalStages([(s, build_hf_stage(hf_model, ranges[s], num_layers)) for s in mine])
