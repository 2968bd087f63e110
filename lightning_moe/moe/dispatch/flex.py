"""Flex dispatcher: token exchange by a fused communication library (DeepEP, Hybrid-EP).

Legend: T tokens, H hidden, K slots per token, E experts in total, P ranks of the EP group,
e = E/P local experts, M tokens this rank receives (each once, whatever the number of its slots
that land here), J routing columns of a received token, R rows this rank's experts process.

The libraries send each token once per destination *rank* (not once per slot) with their own
NVLink/RDMA kernels, and hand back the received tokens with their routing made local. A
:class:`TokenExchange` adapts one library to four calls; the dispatcher around it is the same:

``dispatch``: 1. exchange (the library): ``x_MH``, local expert ids ``ids_MJ`` (``-1``: not on
this rank) and their weights ``w_MJ``; autograd's backward is the library's combine of the
gradient (and of the weights' gradient). 2. permute (local): the received slots sorted by local
expert, ``-1`` slots dropped (``x_RH``). 3. ETP only: ``copy_to_group(ETP)`` marks the rows as
identical over the expert-tensor-parallel group (its ranks hold the same tokens and exchange them
in their own EP groups; backward all-reduces the rows' gradient). With ``etp_sequence_parallel``
(sequence parallel: the ETP ranks hold different tokens) the rows are all-gathered over ETP
instead (``gather_expert_rows``), each ETP rank computing its F slice for all of them.

``combine``: 1. ETP only: all-reduce(ETP) of the partial outputs of the row-parallel ``w2``
(with ``etp_sequence_parallel``: reduce-scatter(ETP) back to the rows' owners).
2. gather-sum of the rows back to the received tokens over their slots (weighted unless the
experts applied the weight), then the library's combine sums every rank's partial outputs into
the source tokens (backward: a dispatch of the gradient with the cached layout).

FP8 rows (``fp8_rows`` set, see ``moe/dispatch/base.py``), when the exchange ``carries_fp8_rows``:
``x_TH`` is quantized once and the exchange moves the FP8 rows with their scales
(``dispatch_fp8``); stage 2 gathers data and scales by the same permutation into ``x_fp8`` and
``x_RH`` is a placeholder; ETP marks it like the activation-dtype rows (with
``etp_sequence_parallel``: the FP8 rows are all-gathered over ETP, ``fp8_rows.gather_expert_fp8_rows``).
The backward is the same gather-sum and ``combine_grads`` as the activation-dtype rows' (gradients
in the activation dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.base import DispatchedTokens, DispatcherCapabilities, Fp8Rows, fp8_rows_of, row_weights
from lightning_moe.moe.dispatch.comm import ExpertRowsLayout, check_etp_sequence_parallel
from lightning_moe.moe.dispatch.ep import ExpertParallelDispatcher
from lightning_moe.moe.dispatch.etp_rows import collect_from_etp, share_over_etp
from lightning_moe.moe.dispatch.fp8_rows import gather_rows, placeholder_rows, quantize_rows
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, unpermute_sum

__all__ = ["FlexDispatcher", "FlexHandle", "TokenExchange"]


class TokenExchange(Protocol):
    """One communication library's dispatch and combine, without autograd.

    ``needs_bf16``: the library moves bfloat16 rows only. ``takes_any_expert_count``: the
    ``num_experts`` of each ``dispatch`` call may differ from the one the exchange was built for
    (no buffer sized by the expert count), so ECHO can route over extra clone slots through it.
    ``carries_fp8_rows``: it has ``dispatch_fp8`` (optional; ``False`` when absent).
    """

    name: str
    needs_bf16: bool
    takes_any_expert_count: bool

    def dispatch(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """-> ``x_MH``, local ids ``ids_MJ`` (``-1`` elsewhere), weights ``w_MJ``, layout."""
        ...

    def combine(self, y_MH: torch.Tensor, layout: Any) -> torch.Tensor:
        """Sum each received token's rows back into its source token: ``y_TH``."""
        ...

    def dispatch_fp8(
        self, x_fp8: Any, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, Any]:
        """``dispatch`` of FP8 rows (an ``Fp8Tensor [T, H]``; scales per row or per (1, 128)):
        -> the received ``Fp8Tensor [M, H]``, ``ids_MJ``, ``w_MJ``, layout (the same layout as
        ``dispatch``'s: ``combine`` and ``combine_grads`` take it unchanged)."""
        ...

    def dispatch_again(self, grad_TH: torch.Tensor, layout: Any) -> torch.Tensor:
        """The backward of ``combine``: ``grad_MH`` over the cached layout."""
        ...

    def combine_grads(
        self, grad_x_MH: torch.Tensor, grad_w_MJ: torch.Tensor, layout: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward of ``dispatch``: ``grad_x_TH`` and ``grad_w_TK``."""
        ...


@dataclass(frozen=True)
class FlexHandle:
    perm: Permutation  # local sort of the received slots by local expert
    weights_MJ: torch.Tensor  # routing weights of the received tokens' slots
    layout: Any  # the library's handle
    etp_rows: ExpertRowsLayout | None = None  # the ETP all-gather (etp_sequence_parallel only)


class _Dispatch(torch.autograd.Function):
    """The library's exchange in one autograd node.

    Activation-dtype rows (``spec`` is ``None``): the first output is the received ``x_MH``. FP8
    rows: the local sort by expert happens in this node too, the sorted FP8 rows go out through
    ``box["x_fp8"]`` (the sort through ``box["perm"]``) and the first output is the placeholder
    ``x_RH``. ``box["layout"]`` is the library's handle either way.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_TH: torch.Tensor,
        ids_TK: torch.Tensor,
        w_TK: torch.Tensor,
        exchange: TokenExchange,
        num_experts: int,
        num_local_experts: int,
        spec: Fp8Rows | None,
        box: dict,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        perm = None
        if spec is None:
            x_out, ids_MJ, w_MJ, layout = exchange.dispatch(x_TH, ids_TK, w_TK, num_experts)
        else:
            q_MH, ids_MJ, w_MJ, layout = exchange.dispatch_fp8(quantize_rows(x_TH, spec), ids_TK, w_TK, num_experts)
            perm = build_permutation(ids_MJ, num_local_experts, None)
            box["perm"], box["x_fp8"] = perm, gather_rows(q_MH, perm.src_token_R)
            x_out = placeholder_rows(x_TH, perm.num_rows, x_TH.shape[-1])
        box["layout"] = layout
        ctx.exchange, ctx.layout, ctx.perm = exchange, layout, perm
        ctx.mark_non_differentiable(ids_MJ)
        return x_out, ids_MJ, w_MJ

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, _grad_ids: Any, grad_w_MJ: torch.Tensor):  # type: ignore[override]
        if ctx.perm is not None:  # the gradient of the sort done in forward
            grad_x = unpermute_sum(grad_x.contiguous(), ctx.perm)
        grad_x_TH, grad_w_TK = ctx.exchange.combine_grads(grad_x.contiguous(), grad_w_MJ.contiguous(), ctx.layout)
        return grad_x_TH, None, grad_w_TK, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_MH: torch.Tensor, exchange: TokenExchange, layout: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange, ctx.layout = exchange, layout
        return exchange.combine(y_MH.contiguous(), layout)

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.dispatch_again(grad_TH.contiguous(), ctx.layout), None, None


class FlexDispatcher(ExpertParallelDispatcher):
    """Experts sharded over ``ep_group``; tokens travel through ``exchange``.

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group.
        etp_group: the expert-tensor-parallel group when each expert's F dimension is sharded
            (``None``: ETP is 1); its ranks must hold identical tokens, as for the all-to-all.
        exchange: the library adapter (``exchange_deepep.py``, ``exchange_hybrid_ep.py``).
        etp_sequence_parallel: the ETP ranks hold different tokens (sequence parallel): rows
            all-gathered over ``etp_group``, ``w2`` partial outputs reduce-scattered back.

    Capabilities: FP8 rows when the exchange carries them (``alltoall_dedup``, ``deepep``).
    """

    fp8_rows = None  # (recipe, fmt, pow2_scales) when the layer's FP8 experts take FP8 rows

    def __init__(
        self,
        num_experts: int,
        *,
        ep_group: ProcessGroup,
        exchange: TokenExchange,
        etp_group: ProcessGroup | None = None,
        etp_sequence_parallel: bool = False,
    ) -> None:
        super().__init__(num_experts, ep_group=ep_group, etp_group=etp_group)
        self.exchange = exchange
        self.etp_sequence_parallel = check_etp_sequence_parallel(type(self).__name__, etp_sequence_parallel)
        self.capabilities = DispatcherCapabilities(carries_fp8_rows=bool(getattr(exchange, "carries_fp8_rows", False)))

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, FlexHandle]:
        self._reject_padding(capacity)
        if self.exchange.needs_bf16 and x_TH.dtype != torch.bfloat16:
            raise ValueError(
                f"FlexDispatcher({self.exchange.name}): activations are {x_TH.dtype}; the library moves bfloat16 "
                "rows. Train in bf16 (precision='bf16-true' or 'bf16-mixed') or use dispatcher='alltoall'."
            )
        spec = fp8_rows_of(self, self.exchange.name)
        box: dict = {}
        ids_TK, w_TK = topk_ids_TK.long().contiguous(), topk_weights_TK.contiguous()
        x_out, ids_MJ, w_MJ = _Dispatch.apply(
            x_TH, ids_TK, w_TK, self.exchange, self.num_experts, self.num_local_experts, spec, box
        )
        if spec is not None:
            perm, x_RH = box["perm"], x_out
        else:
            perm = build_permutation(ids_MJ, self.num_local_experts, None)
            x_RH = permute_rows(x_out, perm)
        w_R = row_weights(w_MJ, perm)
        x_RH, x_fp8, w_R, tokens_per_expert_e, etp_rows = share_over_etp(
            x_RH, box.get("x_fp8"), w_R, perm.tokens_per_expert_E, self.etp_group, self.etp_sequence_parallel
        )
        handle = FlexHandle(perm, w_MJ, box["layout"], etp_rows)
        return DispatchedTokens(x_RH, tokens_per_expert_e, w_R, x_fp8), handle

    def combine(self, y_RH: torch.Tensor, handle: FlexHandle, weighted: bool) -> torch.Tensor:
        y_RH = collect_from_etp(y_RH, handle.etp_rows, self.etp_group)
        weights_MJ = handle.weights_MJ if weighted else None
        y_MH = unpermute_sum(y_RH, handle.perm, weights_MJ)
        return _Combine.apply(y_MH, self.exchange, handle.layout)

    def __repr__(self) -> str:
        return (
            f"FlexDispatcher(exchange={self.exchange.name}, num_experts={self.num_experts}, ep={self.ep_size}, "
            f"local_experts={self.num_local_experts}"
            + ("" if self.fp8_rows is None else f", fp8_rows={self.fp8_rows!r}")
            + ")"
        )
