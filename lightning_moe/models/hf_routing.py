"""What an HF sparse-MoE block computes, as :class:`MoEConfig` fields (read, checked, refused).

Legend: E experts, H hidden, F expert FFN width, K experts per token.

:func:`moe_config_from_block` reads one block of a :data:`~lightning_moe.models.hf_families.FAMILIES`
family: its router (weight ``[E, H]``, bias, correction bias, top-k, renormalisation, groups,
scaling factor), its experts (fused or per-expert, transposed, interleaved, biases, activation)
and its shared expert, and returns the equivalent :class:`MoEConfig`. Anything the layer cannot
compute exactly raises a ``ValueError`` naming the block, the value and the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.config import MoEConfig
from lightning_moe.models.hf_families import FAMILIES, Family, family_of

__all__ = [
    "SUPPORTED_BLOCKS",
    "experts_transposed",
    "gate_up_interleaved",
    "moe_config_from_block",
    "routing_of",
]

# HF class name -> family; matched against the class and its bases, so subclasses swap too.
SUPPORTED_BLOCKS: dict[str, str] = {f.block: f.name for f in FAMILIES.values() if f.refused is None}
_MOE_FIELDS = frozenset(f.name for f in fields(MoEConfig))


def _router_module(fam: Family, block: nn.Module) -> nn.Module:
    return block.get_submodule(fam.router)


def _router_owners(fam: Family, block: nn.Module) -> tuple[nn.Module, ...]:
    """Where routing attributes live: the router, its top-level holder (``gate`` of ``gate.wg``), the block."""
    return (_router_module(fam, block), block.get_submodule(fam.router.split(".")[0]), block)


def _correction_bias(fam: Family, block: nn.Module) -> torch.Tensor | None:
    if fam.bias is None:
        return None
    owner_name, _, attr = fam.bias.rpartition(".")
    owner = block.get_submodule(owner_name) if owner_name else block
    bias = getattr(owner, attr, None)
    return bias if isinstance(bias, torch.Tensor) else None


def _attr(name: str, *owners: Any, default: Any = None) -> Any:
    """First ``owner.<name>`` that exists (``name`` may be ``"a|b"`` for alternatives)."""
    for key in name.split("|"):
        for owner in owners:
            if owner is not None and hasattr(owner, key):
                return getattr(owner, key)
    return default


def _check_silu(name: str, *owners: Any) -> None:
    act = _attr("hidden_act", *owners, default="silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"swap_moe_blocks: block {name} uses hidden_act={act!r}; MoELayer experts are SwiGLU (silu) only. "
            "Leave this model unswapped."
        )


def experts_transposed(fam: Family, experts: nn.Module) -> bool:
    """The HF experts store ``gate_up_proj [E, H, 2F]`` / ``down_proj [E, F, H]``
    (else ``[E, 2F, H]`` / ``[E, H, F]``)."""
    return fam.experts_transposed or bool(getattr(experts, "is_transposed", False))


def gate_up_interleaved(fam: Family, experts: nn.Module) -> bool:
    """The HF experts' fused ``gate_up_proj`` alternates gate and up columns (``[g0, u0, g1, u1, ...]``)."""
    return fam.gate_up_interleaved or not bool(getattr(experts, "is_concatenated", True))


def _expert_biases(experts: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gate_up_proj_bias [E, 2F], down_proj_bias [E, H])`` of fused HF experts, or ``None``s."""
    return getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)


def _router_bias(fam: Family, block: nn.Module) -> torch.Tensor | None:
    bias = getattr(_router_module(fam, block), "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _expert_math(name: str, fam: Family, block: nn.Module, *owners: Any) -> dict[str, Any]:
    """The MoEConfig fields of the block's router bias, expert biases and activation."""
    experts = block.experts
    fields_: dict[str, Any] = {
        "router_bias": _router_bias(fam, block) is not None,
        "expert_mlp_bias": not isinstance(experts, nn.ModuleList) and _expert_biases(experts)[0] is not None,
        "swiglu_alpha": 1.0, "swiglu_limit": None, "swiglu_up_offset": 0.0,
    }  # fmt: skip
    if fam.activation == "swiglu_clamped":
        alpha = _attr("alpha|swiglu_alpha", experts, *owners)
        limit = _attr("limit|swiglu_limit", experts, *owners)
        if alpha is None or limit is None:
            raise ValueError(
                f"swap_moe_blocks: the clamped SwiGLU of {name} has alpha={alpha!r}, limit={limit!r}; set swiglu_alpha "
                "and swiglu_limit in the HF config."
            )
        fields_.update(swiglu_alpha=float(alpha), swiglu_limit=float(limit), swiglu_up_offset=1.0)
    return fields_


def _softmax(num_experts: int, top_k: int, norm: bool, **extra: Any) -> dict[str, Any]:
    out = {"num_experts": num_experts, "top_k": top_k, "score_func": "softmax", "pre_softmax": True,
           "norm_topk_prob": norm, "scaling_factor": None, "num_groups": None, "group_topk": None,
           "group_score_topk": None, "expert_bias": False, "routing_weight_on_input": False}  # fmt: skip
    out.update(extra)
    return out


def _single_expert_renormalised(name: str, top_k: int, norm: bool) -> None:
    if top_k == 1 and norm:
        raise ValueError(
            f"swap_moe_blocks: {name} has num_experts_per_tok=1 with renormalisation (HF weight 1.0 per token, "
            "MoELayer the raw score); set norm_topk_prob=False or top_k >= 2 to swap this model."
        )


def routing_of(fam: Family, *owners: Any) -> str:
    """The family's routing rule; for a ``routing_by`` family, the one its HF attribute names."""
    if fam.routing_by is None:
        return fam.routing
    attr, choices = fam.routing_by
    value = _attr(attr, *owners)
    for choice, routing in choices:
        if value == choice:
            return routing
    raise ValueError(
        f"swap_moe_blocks: {fam.block} has {attr}={value!r}; known: {[c for c, _ in choices]}. Leave this model unswapped."
    )


def _scaling(*owners: Any) -> float:
    return float(_attr("routed_scaling_factor|route_scale", *owners, default=1.0) or 1.0)


def _routing(name: str, fam: Family, block: nn.Module, num_experts: int) -> dict[str, Any]:
    owners = _router_owners(fam, block)
    rule = routing_of(fam, *owners)
    top_k = int(_attr("top_k|num_experts_per_tok|moe_topk", *owners))
    norm = fam.norm if fam.norm is not None else bool(_attr("norm_topk_prob", *owners, default=rule == "sigmoid"))
    if rule == "softmax":
        _single_expert_renormalised(name, top_k, norm)
        return _softmax(num_experts, top_k, norm)
    if rule == "softmax_k":
        if top_k == 1:
            raise ValueError(
                f"swap_moe_blocks: {name} has num_experts_per_tok=1: a softmax over one selected logit is 1.0 for "
                "every token and gives the router no gradient; MoELayer refuses it. Use top_k >= 2."
            )
        return _softmax(num_experts, top_k, True, pre_softmax=False)
    if rule == "softmax_bias":
        # HF divides by clamp(sum, min=moe_norm_min), MoELayer by sum + 1e-20: equal for any sum above 1e-12.
        _single_expert_renormalised(name, top_k, norm)
        scaling = _attr("routed_scaling_factor", *owners)
        return _softmax(num_experts, top_k, norm, expert_bias=True,
                        scaling_factor=None if scaling is None else float(scaling))  # fmt: skip
    if rule == "sigmoid_input":  # top-k of the logits = top-k of their sigmoid
        return {"num_experts": num_experts, "top_k": top_k, "score_func": "sigmoid", "pre_softmax": False,
                "norm_topk_prob": False, "scaling_factor": None, "num_groups": None, "group_topk": None,
                "group_score_topk": None, "expert_bias": False, "routing_weight_on_input": True}  # fmt: skip
    n_group = int(_attr("num_group|n_group", *owners, default=1) or 1)
    topk_group = int(_attr("topk_group", *owners, default=1) or 1)
    scaling = _scaling(*owners)
    if rule == "softmax_scaled":
        method = _attr("topk_method", *owners, default="greedy")
        groups: tuple[int | None, int | None] = (None, None)
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"swap_moe_blocks: {name} has topk_method={method!r}; only 'greedy' and 'group_limited_greedy' "
                "are known. Leave this model unswapped."
            )
        if method == "group_limited_greedy" and topk_group < n_group:
            groups = (n_group, topk_group)  # each group scored by its best expert
        return _softmax(num_experts, top_k, False, scaling_factor=scaling, num_groups=groups[0], group_topk=groups[1],
                        group_score_topk=1 if groups[0] else None)  # fmt: skip
    # sigmoid (DeepSeek-V3 family; MiniMax-M2, AFMoE, LFM2-MoE, Cohere2-MoE without groups or bias)
    grouped = n_group > 1 and topk_group < n_group  # all groups kept: the grouping selects nothing
    if top_k == 1 and norm:
        raise ValueError(
            f"swap_moe_blocks: {name} has num_experts_per_tok=1 with norm_topk_prob=True (HF weight 1.0 per "
            "token, MoELayer the raw sigmoid score); set norm_topk_prob=False or top_k >= 2."
        )
    return {"num_experts": num_experts, "top_k": top_k, "score_func": "sigmoid", "pre_softmax": False,
            "norm_topk_prob": norm, "scaling_factor": scaling,
            "num_groups": n_group if grouped else None, "group_topk": topk_group if grouped else None,
            "group_score_topk": 2 if grouped else None, "expert_bias": _correction_bias(fam, block) is not None,
            "routing_weight_on_input": False}  # fmt: skip


def _check_cohere2(name: str, block: nn.Module) -> None:
    strategy = getattr(block, "shared_expert_combination_strategy", "sum")
    if getattr(block, "shared_experts", None) is not None and strategy != "sum":
        raise ValueError(
            f"swap_moe_blocks: {name} combines its routed and shared experts with shared_expert_combination_strategy="
            f"{strategy!r} ((routed + shared) / 2); MoELayer adds them (a MoEConfig option scaling the layer output "
            "would be needed). Swap models built with 'sum' or num_shared_experts=0; leave this model unswapped."
        )


def _check_longcat(name: str, block: nn.Module) -> None:
    # transformers < 5.25 keeps the count on the experts, later versions on the MoE block
    zero = max(int(getattr(m, "zero_expert_num", 0) or 0) for m in (block, block.experts))
    if zero:
        raise ValueError(
            f"swap_moe_blocks: {name} has zero_expert_num={zero} zero-computation (identity) experts; MoELayer has no "
            "identity experts (a MoEConfig option for them would be needed). Leave this model unswapped."
        )
    if getattr(block.router.classifier, "bias", None) is not None:
        raise ValueError(
            f"swap_moe_blocks: {name} has router_bias=True, a classifier bias that HF's router holds but never adds "
            "to its logits; MoELayer's router_bias would add it. Build the model with router_bias=False."
        )


# Conditions, per family, that only some configurations of a swappable block break.
_FAMILY_CHECKS: dict[str, Callable[[str, nn.Module], None]] = {
    "cohere2_moe": _check_cohere2,
    "longcat_flash": _check_longcat,
}


def _shared(fam: Family, block: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    shared = getattr(block, fam.shared, None) if fam.shared else None
    gate = getattr(block, fam.shared_gate, None) if fam.shared_gate else None
    return shared, gate


def _check_shared(name: str, shared: nn.Module | None, gate: nn.Module | None) -> None:
    linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")] if shared is not None else []
    if shared is not None and any(not isinstance(m, nn.Linear) for m in linears):
        raise ValueError(
            f"swap_moe_blocks: the shared expert of {name} ({type(shared).__name__}) is not a gate_proj/up_proj/"
            "down_proj SwiGLU MLP; leave this model unswapped."
        )
    if any(m.bias is not None for m in linears) or (gate is not None and gate.bias is not None):
        raise ValueError(
            f"swap_moe_blocks: the shared expert of {name} has biases (e.g. mlp_bias=True); MoELayer's shared "
            "expert has none. Leave this model unswapped or build it with mlp_bias=False."
        )


def _check_refused(name: str, block: nn.Module, fam: Family) -> None:
    if fam.refused is not None:
        raise ValueError(
            f"swap_moe_blocks: block {name} ({type(block).__name__}, {fam.name}) cannot be swapped: {fam.refused}. "
            "Leave this model unswapped."
        )


def moe_config_from_block(
    block: nn.Module, hf_config: Any = None, name: str = "block", *, family: Family | None = None, **overrides: Any
) -> tuple[MoEConfig, dict[str, Any]]:
    """The :class:`MoEConfig` equivalent to an HF block, and the routing fields it fixed.

    ``hf_config`` (the model's ``config``) supplies the aux loss: Switch loss with
    ``router_aux_loss_coef`` when ``output_router_logits`` is on, else none. ``family``: the
    block's :class:`Family` when the caller has it (else looked up). ``overrides`` are MoEConfig
    fields and win over everything derived.
    """
    fam = family if family is not None else family_of(block)
    if fam is None:
        raise ValueError(
            f"moe_config_from_block: {type(block).__name__} is not supported; supported: {sorted(SUPPORTED_BLOCKS)}."
        )
    _check_refused(name, block, fam)
    check = _FAMILY_CHECKS.get(fam.name)
    if check is not None:
        check(name, block)
    unknown = set(overrides) - _MOE_FIELDS
    if unknown:
        raise ValueError(
            f"swap_moe_blocks: unknown MoEConfig fields {sorted(unknown)}; choose from {sorted(_MOE_FIELDS)}."
        )
    experts_cfg = getattr(block.experts, "config", None)
    _check_silu(name, experts_cfg, getattr(block, "config", None), hf_config)
    num_experts, hidden = _router_module(fam, block).weight.shape
    routing = _routing(name, fam, block, int(num_experts))
    first = block.experts[0] if isinstance(block.experts, nn.ModuleList) else None
    if first is not None:
        ffn = _attr("gate_proj|w1", first).weight.shape[0]
    else:
        ffn = block.experts.down_proj.shape[1 if experts_transposed(fam, block.experts) else -1]
    shared, shared_gate = _shared(fam, block)
    _check_shared(name, shared, shared_gate)
    routing["shared_expert_ffn_size"] = None if shared is None else int(shared.gate_proj.weight.shape[0])
    routing["shared_expert_gate"] = shared_gate is not None
    routing.update(_expert_math(name, fam, block, experts_cfg, getattr(block, "config", None), hf_config))
    use_aux = bool(getattr(hf_config, "output_router_logits", False))
    derived: dict[str, Any] = {
        "hidden_size": int(hidden),
        "ffn_hidden_size": int(ffn),
        **routing,
        "aux_loss": "switch" if use_aux else "none",
        "aux_loss_coeff": float(getattr(hf_config, "router_aux_loss_coef", 1e-2) or 0.0) if use_aux else 0.0,
    }
    derived.update(overrides)
    return MoEConfig(**derived), routing

