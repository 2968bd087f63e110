"""Sparse upcycling: turn a dense SwiGLU MLP into an :class:`MoELayer` of E copies of it.

Legend: E experts, K experts per token, H hidden, F FFN width.

Every expert starts as a copy of the dense MLP (``w13[e] = [W_gate | W_up]^T``,
``w2[e] = W_down^T``), optionally perturbed by Gaussian noise, and the router starts uniform
(zero weight: every logit equal) or small random. With identical experts the layer computes
``y = s · mlp(x)``, where ``s`` is the sum of the K routing weights of a token. So the upcycled
layer equals the dense MLP at initialisation exactly when ``s = 1``:

* ``softmax`` over the K selected logits, or ``pre_softmax`` / ``sigmoid`` with
  ``norm_topk_prob``: ``s = 1`` for any router (times ``scaling_factor`` if set);
* ``pre_softmax`` without renormalisation: ``s = K/E`` at a uniform router;
* ``sigmoid`` without renormalisation: ``s = K · sigmoid(0) = K/2`` at a uniform router.

With ``match_output=True`` (default) the copied down projection is divided by ``s`` at a uniform
router, so the output equals the dense one at init in every case (the "uniform router" is the
zero router; with a random router and ``s`` depending on it, equality is approximate). A shared
expert, when configured, starts with a zero down projection so it adds nothing at init.
Reference: Komatsuzaki et al., "Sparse Upcycling: Training Mixture-of-Experts from Dense
Checkpoints" (2022).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn as nn

from lightning_moe.config import MoEConfig
from lightning_moe.moe.layer import MoELayer

__all__ = ["dense_swiglu_weights", "is_swiglu_mlp", "topk_weight_sum_at_uniform", "upcycle_mlp", "upcycle_model"]

RouterInit = Literal["zeros", "normal"]


def is_swiglu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` has SwiGLU projections named ``gate/up/down_proj`` or ``w1/w3/w2``."""
    names = {n for n, _ in module.named_children()}
    return {"gate_proj", "up_proj", "down_proj"} <= names or {"w1", "w2", "w3"} <= names


def dense_swiglu_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(W_gate [F, H], W_up [F, H], W_down [H, F])`` of a bias-free SwiGLU MLP.

    Accepts HF-style ``gate_proj/up_proj/down_proj`` (LLaMA, Qwen, Mistral, our ``DenseMLP``) and
    Mixtral-style ``w1/w3/w2`` Linears. Raises ``ValueError`` for other layouts, biases, or a
    non-silu activation (when the module says which: ``act_fn`` or ``config.hidden_act``).
    """
    if {"gate_proj", "up_proj", "down_proj"} <= {n for n, _ in mlp.named_children()}:
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    elif {"w1", "w2", "w3"} <= {n for n, _ in mlp.named_children()}:
        gate, up, down = mlp.w1, mlp.w3, mlp.w2
    else:
        raise ValueError(
            f"upcycle: {type(mlp).__name__} has no gate_proj/up_proj/down_proj (or w1/w3/w2) Linears; "
            "pass a SwiGLU MLP."
        )
    for lin in (gate, up, down):
        if getattr(lin, "bias", None) is not None:
            raise ValueError(f"upcycle: {type(mlp).__name__} has biased projections; MoELayer experts have no bias.")
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    act_fn = getattr(mlp, "act_fn", None)
    if (act is not None and act not in ("silu", "swish")) or (
        act_fn is not None and not isinstance(act_fn, nn.SiLU) and "silu" not in type(act_fn).__name__.lower()
    ):
        raise ValueError(f"upcycle: {type(mlp).__name__} uses activation {act or act_fn!r}; only silu is supported.")
    return gate.weight.detach(), up.weight.detach(), down.weight.detach()


def topk_weight_sum_at_uniform(config: MoEConfig) -> float:
    """Sum ``s`` of a token's K routing weights when every router logit is equal (module doc)."""
    K, E = config.top_k, config.num_experts
    if config.score_func == "softmax":
        s = 1.0 if (not config.pre_softmax or config.norm_topk_prob) else K / E
    else:
        s = 1.0 if (config.norm_topk_prob and K > 1) else K * 0.5
    return s * (config.scaling_factor if config.scaling_factor is not None else 1.0)


@torch.no_grad()
def upcycle_mlp(
    mlp: nn.Module,
    num_experts: int,
    top_k: int,
    *,
    noise_std: float = 0.0,
    router_init: RouterInit = "zeros",
    router_std: float = 0.02,
    match_output: bool = True,
    generator: torch.Generator | None = None,
    layer_name: str = "MoELayer",
    **config_overrides: Any,
) -> MoELayer:
    """An :class:`MoELayer` whose E experts are copies of the dense SwiGLU ``mlp``.

    Args:
        mlp: dense SwiGLU MLP (see :func:`dense_swiglu_weights`). Left unchanged.
        num_experts: E copies.
        top_k: K experts per token.
        noise_std: add ``N(0, (noise_std · std(W))²)`` to each expert's copy of each weight ``W``
            (relative noise; 0 keeps exact copies). Breaks expert symmetry so they can diverge.
        router_init: ``zeros`` (uniform router, the exact-equality case) or ``normal`` with
            ``router_std``.
        match_output: divide each copied ``W_down`` by :func:`topk_weight_sum_at_uniform` so the
            output equals the dense MLP at a uniform router.
        generator: random source for noise and router (reproducible upcycling).
        layer_name: name used in the layer's error messages.
        config_overrides: further :class:`MoEConfig` fields (``score_func``, ``aux_loss``, ...).

    Returns:
        The new layer, on the device and in the dtype of ``mlp``'s weights.
    """
    if noise_std < 0:
        raise ValueError(f"upcycle_mlp: noise_std={noise_std} must be >= 0.")
    if router_init not in ("zeros", "normal"):
        raise ValueError(f"upcycle_mlp: router_init={router_init!r} is unknown; choose 'zeros' or 'normal'.")
    W_gate, W_up, W_down = dense_swiglu_weights(mlp)
    ffn, hidden = W_gate.shape
    config = MoEConfig(
        hidden_size=hidden, ffn_hidden_size=ffn, num_experts=num_experts, top_k=top_k, **config_overrides
    )
    device, dtype = W_gate.device, W_gate.dtype
    layer = MoELayer(config, layer_name=layer_name).to(device=device, dtype=dtype)
    # Buffers (expert bias, counters) stay fp32 whatever the weights' dtype.
    for name, buf in layer.named_buffers():
        buf.data = buf.data.float()

    s = topk_weight_sum_at_uniform(config) if match_output else 1.0
    w13_H2F = torch.cat([W_gate, W_up], dim=0).t()  # [H, 2F], gate columns first
    _copy_into_experts(layer, w13_H2F, W_down.t() / s, noise_std, generator)
    _init_router(layer, router_init, router_std, generator)
    if layer.shared_expert is not None:
        # A shared expert would add a second copy of the MLP; start it at zero output instead.
        layer.shared_expert.down.weight.zero_()
    return layer


def _copy_into_experts(
    layer: MoELayer, w13_H2F: torch.Tensor, w2_FH: torch.Tensor, noise_std: float, generator: torch.Generator | None
) -> None:
    """Every expert a copy of the dense weights, plus ``N(0, (noise_std · std(W))²)`` noise drawn on CPU."""
    num_experts = layer.experts.w13.shape[0]
    layer.experts.w13.copy_(w13_H2F.unsqueeze(0).expand(num_experts, -1, -1))
    layer.experts.w2.copy_(w2_FH.unsqueeze(0).expand(num_experts, -1, -1))
    if noise_std > 0:
        for w, base in ((layer.experts.w13, w13_H2F), (layer.experts.w2, w2_FH)):
            std = float(base.float().std()) * noise_std
            noise = torch.randn(w.shape, generator=generator, dtype=torch.float32, device="cpu") * std
            w.add_(noise.to(device=w.device, dtype=w.dtype))
    layer.experts.seeded_or_loaded = True  # a strategy's expert_init_seed keeps the upcycled weights


def _init_router(layer: MoELayer, router_init: str, router_std: float, generator: torch.Generator | None) -> None:
    """The router at zero (uniform routing) or ``N(0, router_std²)`` drawn on CPU."""
    if router_init == "zeros":
        layer.router.weight.zero_()
    else:
        noise = torch.randn(layer.router.weight.shape, generator=generator, dtype=torch.float32, device="cpu")
        layer.router.weight.copy_(noise * router_std)


def upcycle_model(
    model: nn.Module,
    num_experts: int,
    top_k: int,
    *,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Replace every dense SwiGLU MLP of ``model`` (in place) by :func:`upcycle_mlp` of it.

    Args:
        model: e.g. our ``MoETransformer`` (its ``DenseMLP`` blocks) or a transformers dense
            model (``LlamaMLP``, ``Qwen3MLP``, ...).
        num_experts, top_k: as in :func:`upcycle_mlp`.
        filter_fn: ``(qualified name, module) -> bool`` choosing which MLPs to upcycle; default:
            every module passing :func:`is_swiglu_mlp` that is not inside an :class:`MoELayer`.
        seed: seeds one generator shared by all layers (noise, router), for reproducibility.
        kwargs: forwarded to :func:`upcycle_mlp` (``noise_std``, ``router_init``, MoEConfig fields).

    Returns:
        ``model``. Raises ``ValueError`` when no MLP matches.
    """
    choose = filter_fn or (lambda name, m: is_swiglu_mlp(m))
    inside_moe = {n for n, m in model.named_modules() if isinstance(m, MoELayer)}
    targets = [
        (n, m)
        for n, m in model.named_modules()
        if n and not any(n.startswith(p + ".") for p in inside_moe) and not isinstance(m, MoELayer) and choose(n, m)
    ]
    if not targets:
        raise ValueError(
            f"upcycle_model: no dense SwiGLU MLP found in {type(model).__name__}; pass filter_fn to pick modules."
        )
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, mlp in targets:
        layer = upcycle_mlp(mlp, num_experts, top_k, generator=generator, layer_name=name, **kwargs)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer)
    return model
