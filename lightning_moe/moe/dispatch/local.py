"""The local dispatcher: all E experts on this rank, no communication.

Legend: T tokens, H hidden, K slots per token, E experts in total, R rows the experts process.

The :class:`LocalDispatcher` is what layers are built with; ``parallel/parallelize.py``
replaces it with an expert-parallel one (``moe/dispatch/alltoall.py``, ``allgather.py``,
``flex.py``).

FP8 rows (``fp8_rows`` set, see ``moe/dispatch/base.py``): ``x_TH`` is quantized once and the
gather (stage 2) moves its FP8 data and scales; ``x_RH`` is then a placeholder whose gradient
goes back through the same gather-sum as the activation-dtype rows'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_moe.moe.dispatch.base import DispatchedTokens, DispatcherCapabilities, fp8_rows_of, row_weights
from lightning_moe.moe.dispatch.fp8_rows import dispatch_fp8_rows, gather_rows
from lightning_moe.ops.deferred import Deferred, resolved
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, unpermute_sum

__all__ = ["LocalDispatcher", "LocalHandle"]


@dataclass(frozen=True)
class LocalHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor


@dataclass(frozen=True)
class _LocalRoute:
    """FP8 rows gathered into expert order; the gradient gather-summed back to the tokens."""

    perm: Permutation

    def send(self, q_TH: Any) -> Any:
        return gather_rows(q_TH, self.perm.src_token_R)

    def send_back(self, grad_RH: torch.Tensor) -> torch.Tensor:
        return unpermute_sum(grad_RH, self.perm)  # the gradient of permute_rows


class LocalDispatcher:
    """All E experts live on this rank.

    Stages: 1. build the permutation (stable sort of slots by expert); 2. gather rows;
    combine: 3. weighted gather-sum back to token order. No communication.

    Capabilities: ``run_experts`` (the three stages in one autograd node), the router's fused
    permutation when ``dropless``, rows that recompute may gather again, and FP8 rows
    (``fp8_rows``: quantized once, then gathered).
    """

    ep_size = 1
    ep_group = None
    fp8_rows = None  # (recipe, fmt, pow2_scales) when the layer's FP8 experts take FP8 rows

    def __init__(self, num_experts: int, dropless: bool = False) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.dropless = dropless  # no slot is ever dropped: row count known without a sync
        self.capabilities = DispatcherCapabilities(
            runs_experts=True, takes_router_permutation=dropless, rows_cheap_to_rebuild=True, carries_fp8_rows=True
        )

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, LocalHandle]:
        spec = fp8_rows_of(self)
        perm = build_permutation(topk_ids_TK, self.num_experts, capacity, self.dropless)
        w_R = row_weights(topk_weights_TK, perm)
        handle = LocalHandle(perm, topk_weights_TK)
        if spec is not None:
            x_RH, x_fp8 = dispatch_fp8_rows(x_TH, _LocalRoute(perm), spec)
            return DispatchedTokens(x_RH, perm.tokens_per_expert_E, w_R, x_fp8), handle
        x_RH = permute_rows(x_TH, perm)
        return DispatchedTokens(x_RH, perm.tokens_per_expert_E, w_R), handle

    def combine(self, y_RH: torch.Tensor, handle: LocalHandle, weighted: bool) -> torch.Tensor:
        weights_TK = handle.topk_weights_TK if weighted else None
        return unpermute_sum(y_RH, handle.perm, weights_TK)

    def run_experts(
        self,
        x_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: Deferred,
        capacity: int | None,
        experts: Any,
        perm: Permutation | None = None,
        x_RH: Deferred | None = None,
    ) -> torch.Tensor:
        """dispatch → experts → combine in one autograd node (weights inside the activation).

        Same result as the three calls; saves only the expert hidden state (see
        ``ops/local_experts.py``). ``experts`` is a ``GroupedExperts``. The routing weights (or
        the function computing them) are turned into row weights only after the first expert
        GEMM is launched. ``perm`` (of ``topk_ids_TK``) and ``x_RH`` (``x_TH``'s rows in its
        order, or a ``TakeOnce`` of them) may come already made (``TopKRouter.route_and_permute``).
        """
        if perm is None:
            perm = build_permutation(topk_ids_TK, self.num_experts, capacity, self.dropless)
        dropless = self.dropless and capacity is None
        return experts.forward_local(
            x_TH, perm, lambda: row_weights(resolved(topk_weights_TK), perm, dropless), x_RH
        )

    def __repr__(self) -> str:
        fp8 = "" if self.fp8_rows is None else f", fp8_rows={self.fp8_rows!r}"
        return f"LocalDispatcher(num_experts={self.num_experts}, dropless={self.dropless}{fp8})"
