"""Token dispatchers: move routed tokens to their experts and back.

Legend: T tokens, H hidden, K slots per token, E experts in total, e local experts, R rows the
local experts process.

Every dispatcher has the same two calls, so the layer never asks whether it is distributed:

* ``dispatch(x_TH, topk_ids_TK, topk_weights_TK, capacity) -> (DispatchedTokens, handle)``
  — rows grouped by local expert (``x_RH``), rows per local expert, and each row's weight.
* ``combine(y_RH, handle, weighted) -> y_TH`` — rows back in token order, summed over the K
  slots; ``weighted=False`` when the weight was already applied inside the experts.

Dispatchers are not ``nn.Module``s: they hold no parameters, only process groups. The
:class:`LocalDispatcher` (one rank holds all experts) is what layers are built with;
``parallel/parallelize.py`` replaces it with an expert-parallel one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_moe.ops.deferred import Deferred, resolved
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, unpermute_sum

__all__ = ["DispatchedTokens", "Dispatcher", "LocalDispatcher", "LocalHandle"]


@dataclass(frozen=True)
class DispatchedTokens:
    x_RH: torch.Tensor
    tokens_per_expert_e: torch.Tensor  # rows per local expert (int64, on x's device)
    weights_R: torch.Tensor  # fp32 routing weight of each row (0 for padding rows)


class Dispatcher(Protocol):
    num_local_experts: int

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, Any]: ...

    def combine(self, y_RH: torch.Tensor, handle: Any, weighted: bool) -> torch.Tensor: ...


@dataclass(frozen=True)
class LocalHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor


def row_weights(topk_weights_TK: torch.Tensor, perm: Permutation, dropless: bool = False) -> torch.Tensor:
    """Weight of every row (0 for padding); differentiable w.r.t. ``topk_weights_TK``.

    ``dropless`` (and not padded): every row has a slot, so no mask is needed.
    """
    slot_R = perm.slot_of_row_R
    if dropless and not perm.padded:
        return topk_weights_TK.reshape(-1).index_select(0, slot_R)
    w_R = topk_weights_TK.reshape(-1).index_select(0, slot_R.clamp(min=0))
    return w_R * (slot_R >= 0)


class LocalDispatcher:
    """All E experts live on this rank.

    Stages: 1. build the permutation (stable sort of slots by expert); 2. gather rows;
    combine: 3. weighted gather-sum back to token order. No communication.
    """

    def __init__(self, num_experts: int, dropless: bool = False) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.dropless = dropless  # no slot is ever dropped: row count known without a sync

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, LocalHandle]:
        perm = build_permutation(topk_ids_TK, self.num_experts, capacity, self.dropless)
        x_RH = permute_rows(x_TH, perm)
        w_R = row_weights(topk_weights_TK, perm)
        return DispatchedTokens(x_RH, perm.tokens_per_expert_E, w_R), LocalHandle(perm, topk_weights_TK)

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
        return f"LocalDispatcher(num_experts={self.num_experts}, dropless={self.dropless})"
