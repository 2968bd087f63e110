"""Per-class tensor-parallel plans: which projections of an attention or dense-MLP module are cut by heads.

Legend: H hidden, D head width, N query heads, N_kv key/value heads, tp the TP group size.

:func:`~lightning_moe.parallel.parallelize.parallelize_moe_model` reads :data:`ATTENTION_PLANS`
and :data:`MLP_PLANS` (keyed by class name; a subclass matches its nearest listed base) to shard
each module over the TP mesh. Column-parallel projections keep whole heads on a rank (their
output rows are cut into ``tp`` contiguous blocks, so ``N`` and ``N_kv`` must divide by ``tp``);
the row-parallel output projection all-reduces(TP) its partial sums. Everything not named stays
replicated: every TP rank computes it on the same (full) input and gets the same gradient.

==========================  =====================================================================
layout                      plan
==========================  =====================================================================
``q/k/v`` + ``o_proj``      ``q_proj``/``k_proj``/``v_proj`` column-parallel, ``o_proj`` row-parallel
(Llama-like)                (Qwen2/3-MoE, Mixtral, MiniMax full attention, GLM-4-MoE, dots1,
                            ERNIE-4.5, Granite, HunYuan, Llama 4, gpt-oss, our ``Attention``)
per-head q/k norms          one ``[D]`` weight shared by all heads, applied to this rank's heads:
                            a ``Replicate`` DTensor whose partial gradients are summed over TP
                            (``heads_dim``: where the heads are in the norm's input)
gated query (Qwen3-Next,    ``q_proj`` holds ``[q_h | gate_h]`` per head (``2D`` rows each): the
Qwen3.5)                    column cut keeps each head's query and gate together
full-width q/k norms        OLMoE's RMSNorm over all heads at once: ``q_proj``/``k_proj`` outputs
(OLMoE)                     are all-gathered(TP), the norm runs on the full width on every rank,
                            and this rank's heads are taken after it (backward: all-gather of the
                            gradient, so the norm's gradient is the full one on every rank)
per-head parameters         gpt-oss's attention ``sinks [N]``: cut like the heads (``Shard(0)``),
(gpt-oss)                   the module computing on this rank's values
MLA (DeepSeek-V2/V3)        ``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``) and ``kv_b_proj``
                            column-parallel by heads, ``o_proj`` row-parallel; ``q_a_proj``,
                            ``kv_a_proj_with_mqa`` and their norms replicated. The rotary key
                            columns of ``kv_a_proj_with_mqa`` (from ``kv_lora_rank`` on) are shared
                            by every head: their gradient is all-reduced(TP)
==========================  =====================================================================

Refused at ``tp > 1`` (:attr:`AttentionPlan.refused`): the linear-attention layers of Qwen3-Next
and Qwen3.5 (Gated DeltaNet) and MiniMax (lightning attention). A module whose class name says
it is attention but has no entry is refused too (:func:`attention_plan_of`); at ``tp=1`` nothing
here is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

__all__ = [
    "ATTENTION_PLANS",
    "MLP_PLANS",
    "AttentionPlan",
    "HeadCount",
    "MLPPlan",
    "attention_plan_of",
    "is_attention_like",
    "mlp_plan_of",
    "resolve_linear",
    "sequence_parallel_refusal",
]


@dataclass(frozen=True)
class HeadCount:
    """How many heads a projection's output holds: ``out_features // (per_head * sum(widths))``.

    Attributes:
        proj: the projection's attribute name; ``"a|b"`` takes the first present.
        widths: attributes of the attention module whose sum is one head's width (``("head_dim",)``).
        per_head: row blocks of that width per head (2 for a query with its gate).
    """

    proj: str
    widths: tuple[str, ...] = ("head_dim",)
    per_head: int = 1


@dataclass(frozen=True)
class AttentionPlan:
    """How one attention class is cut over TP (module doc).

    Attributes:
        colwise: projections cut by heads along their output rows (``"a|b"``: the first present).
        rowwise: projections cut along their input columns, outputs all-reduced.
        query_heads / kv_heads: where the head counts checked against ``tp`` come from.
        head_norms: per-head norms (one ``[D]`` weight) applied to this rank's heads.
        heads_dim: the dim of the heads in the input of ``head_norms``.
        full_width_norms: ``(norm, projection)`` pairs whose norm spans all heads; the projection's
            output is all-gathered before the norm and sliced to this rank's heads after it.
        shared_rope: ``(projection, attribute)``: the projection's output columns from
            ``module.<attribute>`` on are shared by all heads; their gradient is summed over TP.
        replicated: projections and norms kept whole on every TP rank (checked to exist).
        head_params: the module's own ``[N]`` parameters, one value per query head (gpt-oss's
            ``sinks``): ``Shard(0)`` DTensors, the module computing on this rank's heads' values.
        refused: why the class cannot be cut (``None``: it can).
    """

    colwise: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    rowwise: tuple[str, ...] = ("o_proj",)
    query_heads: HeadCount = HeadCount("q_proj")
    kv_heads: HeadCount = HeadCount("k_proj")
    head_norms: tuple[str, ...] = ()
    heads_dim: int = 2
    full_width_norms: tuple[tuple[str, str], ...] = ()
    shared_rope: tuple[str, str] | None = None
    replicated: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()
    refused: str | None = None


@dataclass(frozen=True)
class MLPPlan:
    """A dense SwiGLU MLP: ``colwise`` projections cut along the FFN rows, ``rowwise`` along its columns."""

    colwise: tuple[str, ...] = ("gate_proj", "up_proj")
    rowwise: tuple[str, ...] = ("down_proj",)


_LLAMA = AttentionPlan()
_QK_NORM = AttentionPlan(head_norms=("q_norm", "k_norm"))
_GATED_QUERY = AttentionPlan(query_heads=HeadCount("q_proj", per_head=2), head_norms=("q_norm", "k_norm"))
_MLA = AttentionPlan(
    colwise=("q_b_proj|q_proj", "kv_b_proj"),
    query_heads=HeadCount("q_b_proj|q_proj", widths=("qk_head_dim",)),
    kv_heads=HeadCount("kv_b_proj", widths=("qk_nope_head_dim", "v_head_dim")),
    shared_rope=("kv_a_proj_with_mqa", "kv_lora_rank"),
    replicated=("kv_a_proj_with_mqa", "kv_a_layernorm"),
)
_DELTANET = (
    "its in_proj and depthwise conv1d mix the q, k and v channels of every head in one fused layout, and its "
    "recurrent state is per value head; a contiguous column cut would split heads from their gates and "
    "conv channels, and no head-wise permuted cut is implemented"
)

ATTENTION_PLANS: dict[str, AttentionPlan] = {
    "Attention": _QK_NORM,  # lightning_moe.models.transformer.Attention (q_norm/k_norm may be None)
    "Qwen3MoeAttention": _QK_NORM,
    "Qwen2MoeAttention": _LLAMA,
    "MixtralAttention": _LLAMA,
    "MiniMaxAttention": _LLAMA,
    "Glm4MoeAttention": _QK_NORM,  # norms only with use_qk_norm
    "Dots1Attention": _QK_NORM,
    "Ernie4_5_MoeAttention": _LLAMA,
    "GraniteMoeAttention": _LLAMA,
    "Llama4TextAttention": _LLAMA,  # its qk_norm is a weightless L2 norm per head
    "GptOssAttention": AttentionPlan(head_params=("sinks",)),
    "HunYuanMoEV1Attention": AttentionPlan(head_norms=("query_layernorm", "key_layernorm"), heads_dim=1),
    "OlmoeAttention": AttentionPlan(full_width_norms=(("q_norm", "q_proj"), ("k_norm", "k_proj"))),
    "Qwen3NextAttention": _GATED_QUERY,
    "Qwen3_5MoeAttention": _GATED_QUERY,
    "DeepseekV2Attention": _MLA,
    "DeepseekV3Attention": _MLA,
    "Qwen3NextGatedDeltaNet": AttentionPlan(refused=_DELTANET),
    "Qwen3_5MoeGatedDeltaNet": AttentionPlan(refused=_DELTANET),
    "MiniMaxLightningAttention": AttentionPlan(refused=(
        "its qkv_proj fuses the q, k and v of every head and its decay buffers (slope_rate, query/key/diagonal "
        "decay) and output gate are laid out for all heads; no head-wise cut is implemented")),
}  # fmt: skip

_SWIGLU = MLPPlan()
MLP_PLANS: dict[str, MLPPlan] = {
    name: _SWIGLU
    for name in (
        "DenseMLP",  # lightning_moe.models.transformer
        "Qwen3MoeMLP", "Qwen2MoeMLP", "Qwen3NextMLP", "Qwen3_5MoeMLP", "DeepseekV2MLP", "DeepseekV3MLP",
        "Glm4MoeMLP", "Dots1MLP", "Ernie4_5_MoeMLP", "HunYuanMoEV1MLP", "Llama4TextMLP", "OlmoeMLP",
    )
}  # fmt: skip


def _by_class(module: nn.Module, table: dict[str, object]) -> object | None:
    for cls in type(module).__mro__:
        found = table.get(cls.__name__)
        if found is not None:
            return found
    return None


def is_attention_like(module: nn.Module) -> bool:
    """A module whose class name says attention (``*Attention*``, ``*DeltaNet*``) and that holds
    linear projections itself: one a TP plan must know."""
    name = type(module).__name__.lower()
    if "attention" not in name and "deltanet" not in name:
        return False
    return any(isinstance(child, nn.Linear) for child in module.children())


def attention_plan_of(module: nn.Module) -> AttentionPlan | None:
    """The plan of ``module``'s class (or nearest listed base), ``None`` if there is none."""
    found = _by_class(module, ATTENTION_PLANS)
    return found if isinstance(found, AttentionPlan) else None


def resolve_linear(module: nn.Module, names: str) -> str | None:
    """The first of ``"a|b"`` that is an ``nn.Linear`` child of ``module``, else ``None``."""
    return next((n for n in names.split("|") if isinstance(getattr(module, n, None), nn.Linear)), None)


def mlp_plan_of(module: nn.Module) -> MLPPlan | None:
    """The plan of a dense MLP: its class's entry, or the SwiGLU plan for any module holding
    ``gate_proj``/``up_proj``/``down_proj`` linears (the same math in every family)."""
    found = _by_class(module, MLP_PLANS)
    if isinstance(found, MLPPlan):
        return found
    names = (*_SWIGLU.colwise, *_SWIGLU.rowwise)
    return _SWIGLU if all(resolve_linear(module, n) for n in names) else None


def sequence_parallel_refusal(plan: AttentionPlan) -> str | None:
    """Why ``sequence_parallel`` cannot take an attention class of ``plan`` (``None``: it can).

    With sequence parallel the attention's input is one ``Replicate`` DTensor of the gathered
    sequence, read by the column-parallel projections only."""
    if plan.refused is not None:
        return plan.refused
    if plan.replicated:
        return (
            f"its {' and '.join(plan.replicated)} stay whole on every TP rank (multi-head latent attention) and would "
            "read that DTensor with plain weights"
        )
    return None
