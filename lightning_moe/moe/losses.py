"""Router auxiliary losses and the autograd function that puts them into backward.

Symbols: T tokens in the micro-batch, E experts, K experts per token,
``p_{t,i}`` the router probability of expert i for token t (softmax over all E; for sigmoid
scores, the scores normalised to sum to one per token), ``c_i`` the number of tokens whose top-k
contains expert i (before capacity drops).

* Switch / GShard load balancing (Fedus et al. 2021, Lepikhin et al. 2020):
  ``L_aux = coeff * E / (K * T^2) * sum_i c_i * sum_t p_{t,i}``
  which is ``coeff * E / K * sum_i f_i * P_i`` with ``f_i = c_i / T`` and ``P_i = mean_t p_{t,i}``;
  it equals ``coeff`` when the load is uniform.
* Sequence-level (DeepSeek-V2/V3): the same per sequence, averaged over sequences.
* Global (Qiu et al. 2025, "Demons in the detail"): ``f_i`` from counts summed over the
  data-parallel ranks and the micro-batches of the step, ``P_i`` from the local micro-batch.
* Router z-loss (Zoph et al. 2022, ST-MoE): ``L_z = coeff * mean_t (logsumexp_i logits_{t,i})^2``.
"""

from __future__ import annotations

import torch

__all__ = [
    "AuxLossScaler",
    "load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
    "aux_probs",
]


def aux_probs(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """``p_{t,i}`` used by the balancing losses (fp32)."""
    if score_func == "softmax":
        return torch.softmax(logits_TE.float(), dim=-1)
    scores_TE = torch.sigmoid(logits_TE.float())
    return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)


def load_balancing_loss(
    probs_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    num_counted_tokens: int | torch.Tensor,
    top_k: int,
    coeff: float,
) -> torch.Tensor:
    """``coeff * E/K * sum_i (c_i / T_c) * mean_t p_{t,i}``; ``T_c`` tokens produced the counts ``c``.

    With ``T_c = T`` (local counts) this is the Switch formula above.
    """
    E = probs_TE.shape[-1]
    # no tokens (an empty micro-batch, or no counts anywhere): the loss is 0, not 0/0
    n = num_counted_tokens.clamp(min=1) if isinstance(num_counted_tokens, torch.Tensor) else max(num_counted_tokens, 1)
    f_E = tokens_per_expert_E.float() / n
    P_E = probs_TE.float().mean(0) if probs_TE.shape[0] > 0 else probs_TE.float().sum(0)
    return coeff * E / top_k * torch.sum(f_E.detach() * P_E)


def sequence_load_balancing_loss(
    probs_BSE: torch.Tensor, topk_ids_BSK: torch.Tensor, top_k: int, coeff: float
) -> torch.Tensor:
    """The Switch loss per sequence (B sequences of S tokens), averaged over sequences."""
    B, S, E = probs_BSE.shape
    if B == 0 or S == 0:  # no tokens: 0 (kept in the graph), not the mean of nothing
        return probs_BSE.float().sum() * 0.0
    counts_BE = torch.zeros(B, E, device=probs_BSE.device, dtype=torch.float32)
    ones = torch.ones_like(topk_ids_BSK, dtype=torch.float32).view(B, -1)
    valid = topk_ids_BSK.view(B, -1) >= 0
    counts_BE.scatter_add_(1, topk_ids_BSK.view(B, -1).clamp(min=0).long(), ones * valid)
    f_BE = counts_BE / S
    P_BE = probs_BSE.float().mean(1)
    return coeff * E / top_k * (f_BE * P_BE).sum(-1).mean()


def z_loss(logits_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t logsumexp(logits_t)^2``."""
    lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return coeff * (lse_T.square().mean() if lse_T.shape[0] > 0 else lse_T.sum())  # no tokens: 0


class AuxLossScaler(torch.autograd.Function):
    """Return the activation unchanged; in backward, also send ``scale`` into the aux loss.

    Attaching the loss to the layer's output makes it reach the parameters in the same backward
    pass as the main loss, without the user adding it. ``scale`` must equal the factor the
    training loop applies to the main loss (``1 / accumulate_grad_batches``, times the loss scale
    of fp16 mixed precision): the layer owns that number, see ``MoELayer.aux_loss_scale``.
    """

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, grad_aux, None
