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

Every stage runs what the HF decoder runs around its layers, for a plain unpadded batch: positions
``0..S-1``, the model's own rotary embedding (``rotary_emb``, shared by every stage; no
parameters) and the attention mask from transformers' own helpers (``create_causal_mask``, or
``create_sliding_window_causal_mask`` for sliding-window layers, per layer type where the config
has ``layer_types``), each decoder layer then called as the HF decoder calls it
(``layer(h, attention_mask=, position_ids=, position_embeddings=(cos, sin))``). Padding masks,
packed documents, caches and context parallel are not carried between stages.

Parameter names follow :class:`TransformerStage` (``embed.weight``, ``layers.3.self_attn.q_proj.weight``,
``norm.weight``, ``lm_head.weight``); :func:`hf_parameter_name` maps them to the HF model's
(``model.embed_tokens.weight``, ``model.layers.3.self_attn.q_proj.weight``, ``model.norm.weight``,
``lm_head.weight``).

Only families whose decoder forward is exactly that recipe are cut (:data:`MASK_RULES`, checked
against the installed transformers); the others are refused with the reason
(:func:`check_hf_pipeline_model`): tied embeddings, hybrid linear-attention or state-space layers,
vision-language wrappers, scaled embeddings or logits, and families not checked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.pipeline_stage import LocalStages, TransformerStage, check_stage_range

__all__ = [
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
        super().__init__(blocks, functools.partial(_rotary_tables, rotary_emb), embed=embed, norm=norm, lm_head=lm_head)
        self.rotary_emb = rotary_emb
        self.config = config
        self.mask_rule = mask_rule

    def _masks(self, h_BSH: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """The attention mask of each layer type of this stage, as the HF decoder builds it."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self.config, inputs_embeds=h_BSH, attention_mask=None, cache=None, position_ids=position_ids
        )
        if self.mask_rule == "layer_types":
            types = {self.config.layer_types[int(i)] for i in self.layers}
            makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            return {t: makers[t](**kwargs) for t in types}
        sliding = self.mask_rule == "sliding_if_set" and getattr(self.config, "sliding_window", None) is not None
        return {"all": (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kwargs)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_BSH = self.embed(x) if self.embed is not None else x
        position_ids = torch.arange(h_BSH.shape[1], device=h_BSH.device).unsqueeze(0)
        cos_sin = self.rotary_emb(h_BSH, position_ids)
        masks = self._masks(h_BSH, position_ids)
        for index, layer in self.layers.items():
            kind = self.config.layer_types[int(index)] if self.mask_rule == "layer_types" else "all"
            out = layer(h_BSH, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=cos_sin)
            h_BSH = out[0] if isinstance(out, tuple) else out
        if self.lm_head is None:
            return h_BSH
        return self.lm_head(self.norm(h_BSH))


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
