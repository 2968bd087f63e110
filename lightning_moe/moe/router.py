"""Top-k token-choice router.

Legend: T tokens, H hidden, E experts, G expert groups, K experts per token.

Workflow of :meth:`TopKRouter.forward`:

1. ``logits_TE = x_TH @ weight_EH^T`` (``+ bias_E`` with ``router_bias``) in ``router_dtype``
   (fp32 by default).
2. ``scores_TE`` for selection: the logits (softmax over the K selected), ``softmax`` over all E
   (``pre_softmax``) or ``sigmoid``; plus ``expert_bias`` (aux-loss-free balancing), which
   steers selection only and never the weights.
3. Group-limited routing (DeepSeek-V3): group score = sum of the top ``group_score_topk``
   (default ``K/group_topk``) scores of each of the G groups; all but the best ``group_topk``
   groups are masked to ``-inf``.
4. ``topk_ids_TK`` = top-k of the masked scores — or the ids of a routing override (replay).
5. ``topk_weights_TK`` re-gathered from the *unbiased* live scores at those ids (so a replayed
   route still trains the router): softmax over the K logits, or the scores renormalised when
   ``norm_topk_prob``; times ``scaling_factor``.
6. Capacity (``capacity_factor``): slots beyond ``ceil(T*K/E * factor)`` per expert get id -1,
   keeping the highest weights (``probs``) or the earliest tokens (``position``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from lightning_moe.config import MoEConfig
from lightning_moe.ops.backend import csrc_extension
from lightning_moe.ops.deferred import Deferred, ResolvedOnRead, TakeOnce
from lightning_moe.ops.permute import Permutation, count_per_expert
from lightning_moe.ops.route import route
from lightning_moe.ops.router_gemm import kernel_fits, router_logits

__all__ = ["TopKRouter", "RouterOutput", "select_topk", "routing_weights", "drop_over_capacity", "expert_capacity"]

RoutingOverride = Callable[[torch.Tensor], torch.Tensor]


class RouterOutput:
    """What the router hands the layer.

    ``topk_weights_TK`` (a function that computes them on first read) and ``tokens_per_expert_E``
    (routed slots per expert before capacity drops; ``None``) may be left for later: the layer
    reads them after the first expert GEMM is launched, so their small ops stay off the host's
    path to that GEMM (the device waits idle until it arrives: host time there is step time).
    """

    __slots__ = ("logits_TE", "topk_ids_TK", "_topk_weights_TK", "routed_ids_TK", "_tokens_per_expert_E")

    topk_weights_TK = ResolvedOnRead()
    tokens_per_expert_E = ResolvedOnRead()

    def __init__(
        self,
        logits_TE: torch.Tensor,
        topk_ids_TK: torch.Tensor,  # int64; -1 marks a slot dropped by capacity
        topk_weights_TK: Deferred,  # fp32 (router dtype), 0 where dropped
        tokens_per_expert_E: Deferred | None,  # None: counted from routed_ids_TK when first read
        routed_ids_TK: torch.Tensor,  # top-k ids before capacity drops (what the balancing losses count)
    ) -> None:
        self.logits_TE = logits_TE
        self.topk_ids_TK = topk_ids_TK
        self._topk_weights_TK = topk_weights_TK
        self.routed_ids_TK = routed_ids_TK
        if tokens_per_expert_E is None:  # the counts as a deferred computation (no reference back to self)
            tokens_per_expert_E = partial(count_per_expert, routed_ids_TK, logits_TE.shape[-1])
        self._tokens_per_expert_E = tokens_per_expert_E


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(T*K/E * capacity_factor)``."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def selection_scores(logits_TE: torch.Tensor, score_func: str, pre_softmax: bool) -> torch.Tensor:
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    if pre_softmax:
        return torch.softmax(logits_TE, dim=-1)
    return logits_TE


def select_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score_topk: int | None = None,
) -> torch.Tensor:
    """Top-k expert ids of selection scores, optionally group-limited (step 3)."""
    if num_groups is not None and group_topk is not None and num_groups > 1:
        T, E = scores_TE.shape
        scores_TGe = scores_TE.view(T, num_groups, E // num_groups)
        per_group = group_score_topk if group_score_topk is not None else top_k // group_topk
        group_scores_TG = scores_TGe.topk(per_group, dim=-1).values.sum(-1)
        kept_groups_TG = group_scores_TG.topk(group_topk, dim=-1).indices
        group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_groups_TG, True)
        scores_TE = scores_TGe.masked_fill(~group_mask_TG.unsqueeze(-1), float("-inf")).view(T, E)
    return scores_TE.topk(top_k, dim=-1).indices


def routing_weights(
    logits_TE: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    score_func: str,
    pre_softmax: bool,
    norm_topk_prob: bool,
    scaling_factor: float | None,
) -> torch.Tensor:
    """Combine weights at the chosen ids, from the unbiased scores (step 5); differentiable."""
    top_k = topk_ids_TK.shape[-1]
    if score_func == "softmax" and not pre_softmax:
        weights_TK = torch.softmax(logits_TE.gather(1, topk_ids_TK), dim=-1)
    else:
        scores_TE = torch.softmax(logits_TE, dim=-1) if score_func == "softmax" else torch.sigmoid(logits_TE)
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if norm_topk_prob and top_k > 1:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        weights_TK = weights_TK * scaling_factor
    return weights_TK


def drop_over_capacity(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mark slots past each expert's capacity with id -1 and weight 0 (step 6)."""
    T, K = topk_ids_TK.shape
    ids_N = topk_ids_TK.reshape(-1)
    if policy == "probs":
        # Sort by weight descending, then stably by expert: within an expert, highest weight first.
        by_weight_N = torch.argsort(topk_weights_TK.detach().reshape(-1), descending=True, stable=True)
        order_N = by_weight_N[torch.argsort(ids_N[by_weight_N], stable=True)]
    else:
        # Token-major slot order: earlier tokens first.
        order_N = torch.argsort(ids_N, stable=True)
    sorted_ids_N = ids_N[order_N]
    counts_E = count_per_expert(ids_N, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted_N = torch.arange(T * K, device=ids_N.device) - start_E[sorted_ids_N]
    rank_N = torch.empty_like(rank_sorted_N).scatter_(0, order_N, rank_sorted_N)
    keep_TK = (rank_N < capacity).view(T, K)
    return torch.where(keep_TK, topk_ids_TK, -1), topk_weights_TK * keep_TK


class TopKRouter(nn.Module):
    """Scores tokens, picks top-k experts, and owns the aux-loss-free expert bias.

    Hooks published for callbacks: :meth:`set_routing_override` (replay forced ids) and the
    ``tokens_per_expert_since_update`` buffer (counts behind the expert-bias update).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if config.router_bias else None
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer(
                "tokens_per_expert_since_update",
                torch.zeros(config.num_experts, dtype=torch.float32),
                persistent=False,
            )
        else:
            self.expert_bias = None
        self._override: RoutingOverride | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.config.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def set_routing_override(self, override: RoutingOverride | None) -> None:
        """``override(topk_ids_TK) -> forced topk_ids_TK``; ``None`` restores normal routing."""
        self._override = override

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        cfg = self.config
        rdtype = cfg.router_torch_dtype
        if torch.is_autocast_enabled(x_TH.device.type):  # the router runs in its own dtype
            with torch.autocast(device_type=x_TH.device.type, enabled=False):
                logits_TE = router_logits(x_TH, self.weight, rdtype)
        else:  # no context to enter: this is on the host's path to the first expert GEMM
            logits_TE = router_logits(x_TH, self.weight, rdtype)
        if self.bias is not None:
            logits_TE = logits_TE + self.bias.to(rdtype)
        topk_ids_TK = self._select(logits_TE.detach())
        if self._override is not None:
            topk_ids_TK = self._checked_override(topk_ids_TK)
        weights = self._weights(logits_TE, topk_ids_TK)
        topk_weights_TK: Deferred = weights
        tokens_per_expert_E = None  # counted when first read (RouterOutput)
        if self.expert_bias is not None and self.training:
            tokens_per_expert_E = count_per_expert(topk_ids_TK, cfg.num_experts)
            self.tokens_per_expert_since_update += tokens_per_expert_E.float()
        routed_ids_TK = topk_ids_TK
        if cfg.capacity_factor is not None:
            capacity = expert_capacity(x_TH.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
            topk_ids_TK, topk_weights_TK = drop_over_capacity(
                topk_ids_TK, weights(), cfg.num_experts, capacity, cfg.drop_policy
            )
        return RouterOutput(logits_TE, topk_ids_TK, topk_weights_TK, tokens_per_expert_E, routed_ids_TK)

    def route_and_permute(self, x_TH: torch.Tensor) -> tuple[RouterOutput, Permutation, TakeOnce] | None:
        """:meth:`forward`'s output for a dropless layer, with the permutation of its ids and
        ``x_TH``'s rows in expert order (handed over once: whoever takes them holds the only
        reference), all from one extension call (``ops/route.py``); ``None``
        where that call does not apply (then call the router): no CUDA extension, a routing
        override, capacity, a router dtype other than fp32, a router bias, autocast, ``x`` and the
        weight not both bf16 or both fp16, or sizes beyond the kernels' limits."""
        cfg = self.config
        if self._override is not None or cfg.capacity_factor is not None or cfg.router_torch_dtype != torch.float32:
            return None
        if self.bias is not None:
            return None
        if x_TH.dtype != self.weight.dtype or x_TH.dtype not in (torch.bfloat16, torch.float16):
            return None
        selection = self._topk_kernel_args()
        if selection is None or x_TH.shape[0] * cfg.top_k >= 2**31:
            return None
        if torch.is_autocast_enabled(x_TH.device.type) or not kernel_fits(x_TH, self.weight):
            return None
        ext = csrc_extension(x_TH)
        if ext is None:
            return None
        rows = route(ext, x_TH, self.weight, selection)
        perm = rows.perm
        if self.expert_bias is not None and self.training:
            self.tokens_per_expert_since_update += perm.tokens_per_expert_E.float()
        counts: Deferred = lambda: perm.tokens_per_expert_E  # noqa: E731
        out = RouterOutput(rows.logits_TE, rows.topk_ids_TK, self._weights(rows.logits_TE, rows.topk_ids_TK), counts, rows.topk_ids_TK)
        return out, perm, TakeOnce(rows.x_RH)

    def _weights(self, logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Step 5 as a deferred computation (the layer reads it after the first expert GEMM's launch)."""
        cfg = self.config

        def weights() -> torch.Tensor:
            return routing_weights(
                logits_TE, topk_ids_TK, cfg.score_func, cfg.pre_softmax, cfg.norm_topk_prob, cfg.scaling_factor
            )

        return weights

    def _topk_kernel_args(self) -> tuple | None:
        """The csrc top-k selection's arguments after the logits (``router_topk``, also taken by
        ``route``): expert bias, top_k, score function and its options, groups; ``None`` when the
        configuration is beyond the kernel's limits (E <= 1024, K <= 32, at most 32 groups) or
        scores groups by other than their top ``K/group_topk`` (``group_score_topk``)."""
        cfg = self.config
        if cfg.num_experts > 1024 or cfg.top_k > 32 or (cfg.num_groups or 0) > 32:
            return None
        if cfg.group_score_topk is not None and cfg.group_score_topk != cfg.top_k // (cfg.group_topk or 1):
            return None
        bias = None if self.expert_bias is None else self.expert_bias.float().contiguous()
        return (
            bias, cfg.top_k, cfg.score_func, cfg.pre_softmax, cfg.norm_topk_prob,
            float(cfg.scaling_factor or 1.0), int(cfg.num_groups or 0), int(cfg.group_topk or 0),
        )  # fmt: skip

    def _select(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Steps 2-4 without the override: the fused csrc kernel on CUDA, torch otherwise."""
        cfg = self.config
        ext = csrc_extension(logits_TE) if logits_TE.dtype == torch.float32 else None
        selection = self._topk_kernel_args() if ext is not None else None
        if selection is not None:
            ids_TK, _ = ext.router_topk(logits_TE.contiguous(), *selection)
            return ids_TK  # int64, written by the kernel
        scores_TE = selection_scores(logits_TE, cfg.score_func, cfg.pre_softmax)
        if self.expert_bias is not None:
            scores_TE = scores_TE + self.expert_bias.to(scores_TE.dtype)
        return select_topk(scores_TE, cfg.top_k, cfg.num_groups, cfg.group_topk, cfg.group_score_topk)

    def _checked_override(self, computed_TK: torch.Tensor) -> torch.Tensor:
        forced_TK = self._override(computed_TK)  # type: ignore[misc]
        if forced_TK.shape != computed_TK.shape:
            raise ValueError(
                f"TopKRouter: routing override returned ids of shape {tuple(forced_TK.shape)}, "
                f"expected {tuple(computed_TK.shape)}; record and replay with the same batch shape and top_k."
            )
        forced_TK = forced_TK.to(device=computed_TK.device, dtype=torch.long)
        if forced_TK.numel() and (int(forced_TK.min()) < 0 or int(forced_TK.max()) >= self.config.num_experts):
            raise ValueError(
                f"TopKRouter: routing override has expert ids outside [0, {self.config.num_experts}); "
                "replay with the num_experts used when recording."
            )
        return forced_TK

    @torch.no_grad()
    def update_expert_bias(self, group: object | None = None) -> None:
        """``b += rate * sign(mean(c) - c_i)`` from counts since the last update, then reset them.

        ``group``: the process group whose ranks share these experts' data (all-reduced first);
        ``None`` on one process.
        """
        if self.expert_bias is None:
            return
        counts_E = self.tokens_per_expert_since_update
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts_E, group=group)
        self.expert_bias += self.config.bias_update_rate * torch.sign(counts_E.mean() - counts_E)
        counts_E.zero_()
