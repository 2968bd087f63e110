"""What every token dispatcher is: the protocol, its declared capabilities, and the row weights.

Legend: T tokens, H hidden, K slots per token, E experts in total, e local experts, R rows the
local experts process.

Every dispatcher has the same two calls, so the layer never asks whether it is distributed:

* ``dispatch(x_TH, topk_ids_TK, topk_weights_TK, capacity) -> (DispatchedTokens, handle)``
  — rows grouped by local expert (``x_RH``), rows per local expert, and each row's weight.
* ``combine(y_RH, handle, weighted) -> y_TH`` — rows back in token order, summed over the K
  slots; ``weighted=False`` when the weight was already applied inside the experts.

What a dispatcher can do beyond those two calls it declares in ``capabilities``
(:class:`DispatcherCapabilities`); callers read the flags instead of testing for methods or
classes. Dispatchers are not ``nn.Module``s: they hold no parameters, only process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_moe.ops.permute import Permutation

__all__ = ["DispatchedTokens", "Dispatcher", "DispatcherCapabilities", "NO_EXTRAS", "row_weights"]


@dataclass(frozen=True)
class DispatchedTokens:
    x_RH: torch.Tensor
    tokens_per_expert_e: torch.Tensor  # rows per local expert (int64, on x's device)
    weights_R: torch.Tensor  # fp32 routing weight of each row (0 for padding rows)


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatcherCapabilities:
    """What a dispatcher offers beyond ``dispatch`` / ``combine``.

    Attributes:
        runs_experts: it has ``run_experts(x_TH, topk_ids_TK, topk_weights_TK, capacity, experts,
            perm=None, x_RH=None)``, dispatch → experts → combine in one autograd node; the layer
            calls it when ``memory_efficient_permute`` is set.
        takes_router_permutation: its ``run_experts`` accepts the permutation and moved rows made
            by the router's fused call (``TopKRouter.route_and_permute``: one rank, dropless), so
            the layer may ask the router for them.
        rows_cheap_to_rebuild: the dispatched rows are a local gather of the input
            (``handle.perm.src_token_R``; no communication), so activation recompute may drop
            them and gather again in backward instead of saving them.
    """

    runs_experts: bool = False
    takes_router_permutation: bool = False
    rows_cheap_to_rebuild: bool = False


NO_EXTRAS = DispatcherCapabilities()  # only dispatch and combine (every expert-parallel dispatcher)


class Dispatcher(Protocol):
    """The two calls every dispatcher has, its local expert count, its EP size and its capabilities."""

    num_local_experts: int
    ep_size: int  # ranks the experts are sharded over (1: all experts on this rank)
    capabilities: DispatcherCapabilities

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, Any]: ...

    def combine(self, y_RH: torch.Tensor, handle: Any, weighted: bool) -> torch.Tensor: ...


def row_weights(topk_weights_TK: torch.Tensor, perm: Permutation, dropless: bool = False) -> torch.Tensor:
    """Weight of every row (0 for padding); differentiable w.r.t. ``topk_weights_TK``.

    ``dropless`` (and not padded): every row has a slot, so no mask is needed.
    """
    slot_R = perm.slot_of_row_R
    if dropless and not perm.padded:
        return topk_weights_TK.reshape(-1).index_select(0, slot_R)
    w_R = topk_weights_TK.reshape(-1).index_select(0, slot_R.clamp(min=0))
    return w_R * (slot_R >= 0)
