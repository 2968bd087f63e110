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

FP8 rows (``fp8_rows``, see :class:`Dispatcher`): a dispatcher that ``carries_fp8_rows`` quantizes
the rows once before its exchange (``moe/dispatch/fp8_rows.py``) and returns them in
``DispatchedTokens.x_fp8``, with ``x_RH`` a placeholder (a zero-stride ``[R, H]`` tensor in the
activation dtype, costing no memory) that the experts return the real input gradient for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_moe.ops.permute import Permutation

if TYPE_CHECKING:
    from lightning_moe.ops.fp8.quantize import Fp8Tensor

__all__ = [
    "DispatchedTokens",
    "Dispatcher",
    "DispatcherCapabilities",
    "Fp8Rows",
    "NO_EXTRAS",
    "fp8_rows_for",
    "fp8_rows_of",
    "row_weights",
]

Fp8Rows = tuple[str, str, bool]  # (recipe, fmt, pow2_scales) of the rows a dispatcher quantizes


@dataclass(frozen=True)
class DispatchedTokens:
    """Rows grouped by local expert.

    ``x_fp8``: ``None``, or the rows themselves in FP8 (``[R, H]`` data, per-row or per-(1, 128)
    scales) when the dispatcher quantized them before its exchange; ``x_RH`` is then a
    placeholder of the same shape (zeros, zero strides) that carries the rows' gradient.
    """

    x_RH: torch.Tensor
    tokens_per_expert_e: torch.Tensor  # rows per local expert (int64, on x's device)
    weights_R: torch.Tensor  # fp32 routing weight of each row (0 for padding rows)
    x_fp8: Fp8Tensor | None = None


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
        carries_fp8_rows: it honours ``fp8_rows``: quantizes the rows once before its exchange,
            moves FP8 data and fp32 scales (the gradient goes back in the activation dtype), and
            returns them in ``DispatchedTokens.x_fp8``. Dispatchers without it refuse ``fp8_rows``.
    """

    runs_experts: bool = False
    takes_router_permutation: bool = False
    rows_cheap_to_rebuild: bool = False
    carries_fp8_rows: bool = False


NO_EXTRAS = DispatcherCapabilities()  # only dispatch and combine (every expert-parallel dispatcher)


class Dispatcher(Protocol):
    """The two calls every dispatcher has, its local expert count, its EP size and its capabilities.

    ``fp8_rows``: ``None`` (the default: rows move in the activation dtype), or
    ``(recipe, fmt, pow2_scales)`` — ``recipe`` ``"rowwise"`` or ``"blockwise"`` (tile ``(1, 128)``),
    ``fmt`` ``"e4m3"`` or ``"e5m2"`` — set by the layer before ``dispatch`` when its FP8 experts
    take their first GEMM's input from the exchange (``Fp8Config(dispatch=True)``). The dispatcher
    reads it at each ``dispatch``; one without ``capabilities.carries_fp8_rows`` raises a
    ``ValueError`` naming the fix, and ``"tensorwise"`` is refused (one scale over every rank's
    rows cannot be computed before the exchange).
    """

    num_local_experts: int
    ep_size: int  # ranks the experts are sharded over (1: all experts on this rank)
    capabilities: DispatcherCapabilities
    fp8_rows: Fp8Rows | None

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


def fp8_rows_for(dispatcher: Any, rows: Fp8Rows | None) -> Fp8Rows | None:
    """What a layer whose experts take ``rows`` from the exchange sets as ``dispatcher.fp8_rows``.

    ``rows`` when the dispatcher ``carries_fp8_rows`` and the recipe has units of one row
    (rowwise, blockwise); ``None`` otherwise, so the rows move in the activation dtype and the
    experts quantize them (``Fp8Config.dispatch``: "where the dispatcher can carry FP8 rows").
    """
    if rows is None or rows[0] == "tensorwise" or not dispatcher.capabilities.carries_fp8_rows:
        return None
    return rows


def fp8_rows_of(dispatcher: Any, detail: str = "") -> Fp8Rows | None:
    """``dispatcher.fp8_rows`` checked: ``None``, or a ``(recipe, fmt, pow2_scales)`` it can carry.

    A dispatcher without ``capabilities.carries_fp8_rows`` asked for FP8 rows, a tensorwise or
    unknown recipe, an unknown format or a non-bool ``pow2_scales``: a ``ValueError`` naming the
    dispatcher (and ``detail``, e.g. its exchange) and the fix.
    """
    spec = getattr(dispatcher, "fp8_rows", None)
    if spec is None:
        return None
    name = type(dispatcher).__name__ + (f"({detail})" if detail else "")
    if not dispatcher.capabilities.carries_fp8_rows:
        raise ValueError(
            f"{name}: FP8 token dispatch was asked for (fp8_rows={spec!r}), but this dispatcher cannot carry "
            "FP8 rows and their scales; choose dispatcher='alltoall' (or 'alltoall_dedup'), or set "
            "Fp8Config(dispatch=False) to dispatch in the activation dtype."
        )
    if not (isinstance(spec, tuple) and len(spec) == 3):
        raise TypeError(f"{name}: fp8_rows={spec!r} is not a (recipe, fmt, pow2_scales) tuple; pass one or None.")
    recipe, fmt, pow2 = spec
    if recipe not in ("rowwise", "blockwise"):
        raise ValueError(
            f"{name}: fp8_rows recipe={recipe!r} cannot be quantized per row before the exchange (rowwise or "
            "blockwise only; tensorwise needs one scale over every rank's rows); set Fp8Config(dispatch=False) "
            "or recipe='rowwise'/'blockwise'."
        )
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"{name}: fp8_rows fmt={fmt!r} is unknown; choose 'e4m3' or 'e5m2'.")
    if not isinstance(pow2, bool):
        raise TypeError(f"{name}: fp8_rows pow2_scales={pow2!r} is not a bool; pass True or False.")
    return spec
