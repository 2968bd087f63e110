"""Swap Hugging Face sparse-MoE blocks for :class:`MoELayer` in place, and put them back.

Legend: E experts, H hidden, F expert FFN width, F_s shared-expert width, K experts per token.

:func:`swap_moe_blocks` walks a model (any ``nn.Module``; usually a transformers
``*ForCausalLM``) and replaces every supported block by an :class:`HFMoELayer` — a
:class:`MoELayer` that holds the *same* weights, routes the same way, and returns what the parent
decoder layer expects (a tensor in transformers 5.x, ``(tensor, router_logits)`` in 4.x). The
original block is kept on the ``meta`` device (no memory) so :func:`export_moe_blocks` can rebuild
it with the possibly trained weights.

Supported blocks: the non-refused entries of :data:`~lightning_moe.models.hf_families.FAMILIES`
(one per HF block class: router location, routing rule, correction bias, shared expert), in the
transformers 5.x layout (router ``weight [E, H]``, ``experts.gate_up_proj [E, 2F, H]`` gate first,
``experts.down_proj [E, H, F]``) or the 4.x per-expert ``ModuleList``:

=============================  ==============================================================
Qwen3-MoE, OLMoE               softmax over E, top-k, optional renormalisation (``norm_topk_prob``)
Qwen2-MoE, Qwen3-Next          as Qwen3, plus a shared expert gated by ``sigmoid(x @ g)``
Qwen3.5-MoE                    as Qwen3-Next, always renormalised
Mixtral, MiniMax               softmax over E, top-k, always renormalised; optional input jitter
HunYuan-MoE                    softmax over E, top-k, renormalised (router ``gate.wg``); an
                               ungated shared MLP (``shared_mlp``)
Granite-MoE                    top-k of the logits, softmax over the K selected (``router``)
ERNIE-4.5-MoE                  softmax over E, selection by softmax + correction bias
                               (``gate.moe_statics.e_score_correction_bias``), renormalised;
                               optional shared experts
DeepSeek-V2                    softmax over E, top-k (greedy, or group-limited with groups scored
                               by their best expert: ``group_score_topk=1``), not renormalised,
                               times ``routed_scaling_factor``; shared experts
DeepSeek-V3, GLM-4-MoE, dots1  sigmoid scores, ``e_score_correction_bias`` (our ``expert_bias``)
                               for selection only, group-limited top-k (groups scored by their
                               top-2: ``group_score_topk=2``), renormalised, times
                               ``routed_scaling_factor``; shared experts
Llama 4 (text)                 top-k of the logits, weight ``sigmoid(logit)`` applied to the
                               expert's input (``routing_weight_on_input``); experts stored
                               ``[E, H, 2F]`` / ``[E, F, H]``; an ungated shared expert
gpt-oss                        top-k of the logits (router with a bias: ``router_bias``), softmax
                               over the K selected; experts with biases (``expert_mlp_bias``),
                               gate/up columns interleaved, stored ``[E, H, 2F]``; clamped SwiGLU
                               ``g * sigmoid(alpha * g) * (u + 1)`` (``swiglu_alpha``,
                               ``swiglu_limit``, ``swiglu_up_offset=1``)
=============================  ==============================================================

Refused, with the reason in the ``ValueError``: PhiMoE (SparseMixer routing). A softmax family
with ``num_experts_per_tok=1`` and renormalisation (HF weight 1.0 per token) is refused too.

Weight mapping (ours ← HF): ``router.weight ← <router>.weight``; ``router.bias ← <router>.bias``;
``experts.w13[e] ← gate_up_proj[e].T`` (gate columns first: an interleaved ``gate_up_proj`` is
de-interleaved); ``experts.w2[e] ← down_proj[e].T``; ``experts.b13 ← gate_up_proj_bias`` (gate
first), ``experts.b2 ← down_proj_bias``; ``router.expert_bias ← <router>.<bias>``;
``shared_expert.gate_up ← cat(gate_proj, up_proj)``, ``shared_expert.down ← down_proj``,
``shared_expert.gate ← shared_expert_gate``.

Aux loss: transformers computes its load-balancing loss from router logits it records on its own
router class, over all layers at once; after a swap there are none, so the swap turns
``config.output_router_logits`` off and, when it was on, gives each layer our Switch loss with
``aux_loss_coeff = router_aux_loss_coef`` (per layer, so not bitwise the HF value). Export restores
the flag (do not pass ``output_router_logits=True`` to a swapped model's ``forward``: transformers
would compute its loss over no recorded logits). Pass MoEConfig fields as keyword arguments to
override anything (e.g. ``experts_backend="torch"``, ``aux_loss="seq"``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.config import MoEConfig
from lightning_moe.models.hf_families import FAMILIES, Family, family_of
from lightning_moe.models.hf_packed import packed_attention_mask, packed_forward_kwargs
from lightning_moe.models.hf_routing import (
    SUPPORTED_BLOCKS,
    _attr,
    _check_refused,
    _correction_bias,
    _expert_biases,
    _interleaved,
    _router_bias,
    _router_module,
    _shared,
    _transposed,
    moe_config_from_block,
)
from lightning_moe.moe.layer import MoELayer

__all__ = [
    "SUPPORTED_BLOCKS",
    "HFMoELayer",
    "export_moe_blocks",
    "moe_config_from_block",
    "packed_attention_mask",
    "packed_forward_kwargs",
    "swap_moe_blocks",
]

_BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES.values()}
# Fields that decide the layer's math; export refuses a layer whose values no longer match HF's.
_ROUTING_FIELDS = (
    "num_experts",
    "top_k",
    "score_func",
    "pre_softmax",
    "norm_topk_prob",
    "scaling_factor",
    "num_groups",
    "group_topk",
    "group_score_topk",
    "expert_bias",
    "shared_expert_ffn_size",
    "shared_expert_gate",
    "routing_weight_on_input",
    "router_bias",
    "expert_mlp_bias",
    "swiglu_alpha",
    "swiglu_limit",
    "swiglu_up_offset",
)
# Parameters of the router_bias / expert_mlp_bias options: zero when an override adds them to a block without them.
_OVERRIDE_BIASES = ("router.bias", "experts.b13", "experts.b2")


class HFMoELayer(MoELayer):
    """A :class:`MoELayer` standing in for an HF sparse-MoE block.

    Differences from :class:`MoELayer`: ``forward`` applies Mixtral's training-time input jitter
    when the HF block had one, and returns ``(y, router_logits)`` when the replaced block did
    (transformers 4.x). ``hf_block`` is the original block on the ``meta`` device (not a
    submodule, so it is in no state dict and costs no memory).
    """

    def __init__(
        self,
        config: MoEConfig,
        layer_name: str,
        family: str,
        hf_block: nn.Module,
        returns_router_logits: bool = False,
        jitter_noise: float = 0.0,
        hf_routing: dict[str, Any] | None = None,
        hf_output_router_logits: bool | None = None,
        flat_output: bool = False,
    ) -> None:
        super().__init__(config, layer_name=layer_name)
        self.family = family
        self._hf_block = [hf_block]  # a list, so nn.Module does not register it
        self.returns_router_logits = returns_router_logits
        self.jitter_noise = jitter_noise
        self.hf_routing = dict(hf_routing or {})
        self.hf_output_router_logits = hf_output_router_logits
        self.flat_output = flat_output
        self._last_router_logits: torch.Tensor | None = None
        if returns_router_logits:
            self.router.register_forward_hook(self._keep_logits)

    @property
    def hf_block(self) -> nn.Module:
        """The replaced HF block, on ``meta`` (its class, config and non-weight attributes)."""
        return self._hf_block[0]

    def _keep_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        self._last_router_logits = output.logits_TE

    def forward(self, x: torch.Tensor) -> Any:  # tensor, or (tensor, router_logits) for 4.x parents
        if self.flat_output:  # ERNIE-4.5-VL hands each modality's rows over as one flat vector
            x = x.reshape(-1, self.config.hidden_size)
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        y = super().forward(x)
        if not self.returns_router_logits:
            return y
        logits_TE = self._last_router_logits
        self._last_router_logits = None
        if self.flat_output:
            return y.flatten(), logits_TE.flatten()  # type: ignore[union-attr]
        return y, logits_TE.to(x.dtype)  # type: ignore[union-attr]

    def extra_repr(self) -> str:
        return f"family={self.family!r}, " + super().extra_repr()


# --- reading HF blocks -----------------------------------------------------------------------

def _returns_tuple(block_cls: type) -> bool:
    """Whether ``block_cls.forward`` returns a tuple (``(hidden, router_logits)`` in transformers 4.x)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(block_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    func = tree.body[0]
    returns = [n for n in ast.walk(func) if isinstance(n, ast.Return) and n.value is not None]
    return any(isinstance(r.value, ast.Tuple) for r in returns)

def _gate_first(t: torch.Tensor) -> torch.Tensor:
    """Interleaved ``[g0, u0, g1, u1, ...]`` last-dim columns as ``[gate | up]`` (a new tensor)."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` last-dim columns as ``[g0, u0, g1, u1, ...]`` (inverse of :func:`_gate_first`)."""
    F = t.shape[-1] // 2
    out = torch.empty_like(t)
    out[..., ::2], out[..., 1::2] = t[..., :F], t[..., F:]
    return out

def _experts_tensors(name: str, fam: Family, experts: nn.Module) -> dict[str, torch.Tensor]:
    """``experts.w13 [E, H, 2F]``, ``experts.w2 [E, F, H]`` and, with biases, ``experts.b13 [E, 2F]``
    and ``experts.b2 [E, H]``, as new contiguous tensors (gate columns first)."""
    if isinstance(experts, nn.ModuleList):  # transformers 4.x: one MLP per expert
        w13, w2 = [], []
        for mlp in experts:
            gate = _attr("gate_proj|w1", mlp).weight.detach()  # [F, H]
            up = _attr("up_proj|w3", mlp).weight.detach()
            down = _attr("down_proj|w2", mlp).weight.detach()  # [H, F]
            w13.append(torch.cat([gate, up], dim=0).t())
            w2.append(down.t())
        return {"experts.w13": torch.stack(w13).contiguous(), "experts.w2": torch.stack(w2).contiguous()}
    if not hasattr(experts, "gate_up_proj"):
        raise ValueError(f"swap_moe_blocks: cannot read the experts of {name} ({type(experts).__name__}).")
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if not _transposed(fam, experts):  # stored as [E, 2F, H] and [E, H, F]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    interleaved = _interleaved(fam, experts)
    copy = torch.contiguous_format
    out = {"experts.w13": _gate_first(gate_up) if interleaved else gate_up.clone(memory_format=copy),
           "experts.w2": down.clone(memory_format=copy)}  # fmt: skip
    b13, b2 = _expert_biases(experts)
    if (b13 is None) != (b2 is None) or (b13 is None and getattr(experts, "has_bias", False)):
        raise ValueError(
            f"swap_moe_blocks: experts of {name} ({type(experts).__name__}) have biases other than gate_up_proj_bias "
            "and down_proj_bias (both or neither); leave this model unswapped."
        )
    if b13 is not None and b2 is not None:
        b13 = b13.detach()
        out["experts.b13"] = _gate_first(b13) if interleaved else b13.clone(memory_format=copy)
        out["experts.b2"] = b2.detach().clone(memory_format=copy)
    return out

# --- swap ------------------------------------------------------------------------------------


def _param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=requires_grad)


def _build_layer(
    name: str, block: nn.Module, fam: Family, config: MoEConfig, routing: dict[str, Any], hf_config: Any
) -> HFMoELayer:
    gate_w = _router_module(fam, block).weight
    device, requires_grad = gate_w.device, gate_w.requires_grad
    tensors: dict[str, torch.Tensor] = {"router.weight": gate_w.detach().clone()}
    router_bias = _router_bias(fam, block)
    if router_bias is not None:
        tensors["router.bias"] = router_bias.detach().clone()
    tensors.update(_experts_tensors(name, fam, block.experts))
    bias = _correction_bias(fam, block)
    shared, shared_gate = _shared(fam, block)
    if shared is not None:
        gate_up = torch.cat([shared.gate_proj.weight.detach(), shared.up_proj.weight.detach()], dim=0)
        tensors["shared_expert.gate_up.weight"] = gate_up
        tensors["shared_expert.down.weight"] = shared.down_proj.weight.detach().clone()
    if shared_gate is not None:
        tensors["shared_expert.gate.weight"] = shared_gate.weight.detach().clone()

    hf_block = block.to("meta")  # keep class, config and attributes; drop the memory
    # Built on meta so no random init runs; every MoELayer buffer starts at zero.
    with torch.device("meta"):
        layer = HFMoELayer(
            config,
            layer_name=name,
            family=fam.name,
            hf_block=hf_block,
            returns_router_logits=_returns_tuple(type(block)),
            jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
            hf_routing=routing,
            hf_output_router_logits=getattr(hf_config, "output_router_logits", None),
            flat_output=fam.flat_output,
        )
    layer.to_empty(device=device)
    for buf in layer.buffers():
        buf.zero_()
    if bias is not None and layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(bias.detach().float().reshape(-1))
    ours = {n for n, _ in layer.named_parameters()}
    for key, value in tensors.items():
        if key not in ours:  # an override turned this option off (export then refuses the layer)
            continue
        owner_name, _, attr = key.rpartition(".")
        setattr(layer.get_submodule(owner_name), attr, _param(value, requires_grad))
    for key in sorted((ours - set(tensors)) & set(_OVERRIDE_BIASES)):  # an override turned it on: from zero
        owner_name, _, attr = key.rpartition(".")
        zeros = torch.zeros_like(layer.get_parameter(key))
        setattr(layer.get_submodule(owner_name), attr, _param(zeros, requires_grad))
    unset = sorted(ours - set(tensors) - set(_OVERRIDE_BIASES))
    if unset:  # internal invariant: a new MoELayer parameter needs a mapping here
        raise RuntimeError(f"swap_moe_blocks: no HF weight maps to {unset} of {name}; extend models/hf.py.")
    return layer


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


@torch.no_grad()
def swap_moe_blocks(model: nn.Module, **overrides: Any) -> nn.Module:
    """Replace every supported HF MoE block under ``model`` by an equivalent :class:`HFMoELayer`.

    Args:
        model: any module; usually a transformers causal LM. Modified in place and returned.
        overrides: :class:`MoEConfig` fields applied to every swapped layer (e.g.
            ``experts_backend="torch"``, ``aux_loss="switch"``, ``aux_loss_coeff=1e-3``).

    Returns:
        ``model``, with ``config.output_router_logits`` turned off when present (see module doc).

    Raises:
        ValueError: when ``model`` holds no supported block (nothing to swap), or a block's
            routing cannot be expressed exactly by :class:`MoELayer`.
    """
    hf_config = getattr(model, "config", None)
    found = [(n, m, fam) for n, m in model.named_modules() if n and (fam := family_of(m)) is not None]
    for n, m, fam in found:
        _check_refused(n, m, fam)
    # every block's config first: a block that cannot be swapped leaves the model untouched
    targets = [(n, m, fam, *moe_config_from_block(m, hf_config, n, family=fam, **overrides)) for n, m, fam in found]
    if not targets:
        found = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(
            f"swap_moe_blocks: no supported MoE block in {type(model).__name__} (MoE-like classes found: {found}); "
            f"supported: {sorted(SUPPORTED_BLOCKS)}."
        )
    for name, block, fam, config, routing in targets:
        layer = _build_layer(name, block, fam, config, routing, hf_config)
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, layer)
    if hf_config is not None and getattr(hf_config, "output_router_logits", False):
        hf_config.output_router_logits = False  # our layers add their own aux loss (module doc)
    return model


# --- export ----------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded DTensor (FSDP2 / expert parallel)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _check_exportable(layer: HFMoELayer) -> None:
    changed = {k: getattr(layer.config, k) for k in _ROUTING_FIELDS if getattr(layer.config, k) != layer.hf_routing[k]}
    if changed:
        raise ValueError(
            f"export_moe_blocks: layer {layer.layer_name} was swapped with routing overrides {changed} that the HF "
            f"block cannot hold (HF values: { {k: layer.hf_routing[k] for k in changed} }); train without them."
        )


def _write_experts(layer: HFMoELayer, fam: Family, experts: nn.Module, requires_grad: bool) -> None:
    w13, w2 = _full(layer.experts.w13).detach(), _full(layer.experts.w2).detach()
    if hasattr(experts, "gate_up_proj"):
        interleaved = _interleaved(fam, experts)
        gate_up = _interleave(w13) if interleaved else w13.clone()
        if _transposed(fam, experts):
            experts.gate_up_proj = _param(gate_up, requires_grad)
            experts.down_proj = _param(w2.clone(), requires_grad)
        else:
            experts.gate_up_proj = _param(gate_up.transpose(1, 2).contiguous(), requires_grad)
            experts.down_proj = _param(w2.transpose(1, 2).contiguous(), requires_grad)
        if layer.experts.b13 is not None and layer.experts.b2 is not None:
            b13 = _full(layer.experts.b13).detach()
            experts.gate_up_proj_bias = _param(_interleave(b13) if interleaved else b13.clone(), requires_grad)
            experts.down_proj_bias = _param(_full(layer.experts.b2).detach().clone(), requires_grad)
        return
    F = w2.shape[1]
    for e, mlp in enumerate(experts):  # transformers 4.x ModuleList
        _attr("gate_proj|w1", mlp).weight = _param(w13[e, :, :F].t().contiguous(), requires_grad)
        _attr("up_proj|w3", mlp).weight = _param(w13[e, :, F:].t().contiguous(), requires_grad)
        _attr("down_proj|w2", mlp).weight = _param(w2[e].t().contiguous(), requires_grad)


@torch.no_grad()
def _rebuild_block(layer: HFMoELayer) -> nn.Module:
    _check_exportable(layer)
    router_w = layer.router.weight
    block = layer.hf_block.to_empty(device=_full(router_w).device)
    for buf in block.buffers():
        buf.zero_()
    layer._hf_block = [block]  # no longer on meta; the layer is dropped by the caller
    rg = router_w.requires_grad
    fam = _BY_NAME[layer.family]
    _router_module(fam, block).weight = _param(_full(router_w).detach().clone(), rg)
    if layer.router.bias is not None:
        _router_module(fam, block).bias = _param(_full(layer.router.bias).detach().clone(), rg)
    _write_experts(layer, fam, block.experts, rg)
    hf_bias = _correction_bias(fam, block)
    if hf_bias is not None:
        ours = layer.router.expert_bias
        hf_bias.copy_(_full(ours).to(hf_bias.dtype).view_as(hf_bias) if ours is not None else torch.zeros_like(hf_bias))
    shared, shared_gate = _shared(fam, block)
    if shared is not None and layer.shared_expert is not None:
        gate_up = _full(layer.shared_expert.gate_up.weight).detach()
        Fs = gate_up.shape[0] // 2
        shared.gate_proj.weight = _param(gate_up[:Fs].clone(), rg)
        shared.up_proj.weight = _param(gate_up[Fs:].clone(), rg)
        shared.down_proj.weight = _param(_full(layer.shared_expert.down.weight).detach().clone(), rg)
    if shared_gate is not None and layer.shared_expert is not None and layer.shared_expert.gate is not None:
        shared_gate.weight = _param(_full(layer.shared_expert.gate.weight).detach().clone(), rg)
    return block


def export_moe_blocks(model: nn.Module) -> nn.Module:
    """Put the HF blocks back, holding the layers' current weights (inverse of :func:`swap_moe_blocks`).

    Expert weights are transposed back to HF's layout; sharded (DTensor) weights are gathered
    first; ``config.output_router_logits`` is restored. Bitwise exact: ``swap`` then ``export``
    gives the original state dict. Raises ``ValueError`` for a layer swapped with routing
    overrides the HF block cannot express, and when ``model`` holds no :class:`HFMoELayer`.
    """
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoELayer)]
    if not layers:
        raise ValueError(
            f"export_moe_blocks: {type(model).__name__} holds no HFMoELayer; call swap_moe_blocks(model) first."
        )
    restore = None
    for name, layer in layers:
        block = _rebuild_block(layer)
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, block)
        restore = layer.hf_output_router_logits if restore is None else restore
    hf_config = getattr(model, "config", None)
    if hf_config is not None and restore is not None and hasattr(hf_config, "output_router_logits"):
        hf_config.output_router_logits = restore
    if any(isinstance(m, HFMoELayer) for m in model.modules()):
        warnings.warn("export_moe_blocks: nested HFMoELayer left in place.", stacklevel=2)
    return model

