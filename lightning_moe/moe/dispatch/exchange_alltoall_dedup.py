"""Token exchange over ``torch.distributed`` all-to-all, each token sent once per destination rank.

Legend: T tokens, H hidden, K slots per token, E experts, P ranks of the EP group, e = E/P local
experts, N (token, rank) pairs this rank sends, M tokens it receives.

:class:`~lightning_moe.moe.dispatch.alltoall.AllToAllDispatcher` sends one row per routed *slot*:
a token whose K experts sit on one rank crosses the link K times. This exchange, behind
:class:`~lightning_moe.moe.dispatch.flex.FlexDispatcher` (the DeepEP shape, on plain NCCL or gloo),
sends a token once to every rank holding at least one of its experts, with its K routing columns
made local there (``-1`` elsewhere); the receiving rank expands it to slots, and combine sends back
one partial sum per (token, rank). Bytes over the links: ``H`` per (token, rank) pair instead of
``H`` per slot (top-8 over 2 ranks: about 4x fewer).

``dispatch``: 1. ``in_rank_TP``: the ranks each token reaches (dropped slots, id ``-1``, reach
none). 2. A2A of the pair counts; # SYNC: the split sizes to the host (one copy). 3. send order:
the (rank, token) pairs rank-major, tokens ascending (``send_N``, no further sync: N is known).
4. A2A of the rows ``x_TH[send_N]`` and of ``[local ids | weights]`` packed in one float tensor
(ids below 2**24 are exact in fp32). ``combine``: A2A back, then ``index_add`` of the partial sums
into the source tokens (in fp32 at least). The backward calls are the same two moves mirrored.

``dispatch_fp8``: the same exchange for FP8 rows: stage 4 sends each row's FP8 data and fp32
scales packed in one ``uint8`` row (``moe/dispatch/fp8_rows.py``), so a row costs ``H + 4`` bytes
(rowwise) or ``H + 4 ceil(H/128)`` (blockwise) instead of ``2 H`` in bfloat16.

Overlap (``comm_turns`` set, by a pipeline whose schedule overlaps one micro-batch's forward with
another's backward): the all-to-alls of the rows (dispatch, combine and their mirrored backward
calls; not the counts, whose sizes go to the host, nor the small routing columns) are issued
asynchronously and the turn handed to the other micro-batch while they are in flight
(``moe/dispatch/turns.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.comm import exchange_rows
from lightning_moe.moe.dispatch.fp8_rows import pack_rows, unpack_rows
from lightning_moe.moe.dispatch.turns import CommTurns

__all__ = ["AllToAllTokenExchange"]


@dataclass(frozen=True)
class _Layout:
    send_N: torch.Tensor  # the token of every sent row, rank-major
    send_splits: list[int]  # [P] rows sent to each rank
    recv_splits: list[int]  # [P] rows received from each rank
    num_tokens: int  # T


class AllToAllTokenExchange:
    """One row per (token, destination rank) over ``group`` with ``torch.distributed.all_to_all_single``."""

    name = "alltoall_dedup"
    takes_any_expert_count = True
    needs_bf16 = False
    carries_fp8_rows = True
    comm_turns: CommTurns | None = None  # set by a pipeline that overlaps micro-batches (module docstring)

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def dispatch(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Layout]:
        P = self.group.size()
        e = num_experts // P
        T, K = ids_TK.shape
        kept_TK = ids_TK >= 0
        dest_TK = torch.where(kept_TK, ids_TK // e, P)  # P: no rank (a dropped slot)
        in_rank_TP = torch.zeros(T, P + 1, dtype=torch.bool, device=ids_TK.device)
        in_rank_TP = in_rank_TP.scatter_(1, dest_TK, True)[:, :P]
        send_P = in_rank_TP.sum(0)
        recv_P = exchange_rows(send_P.view(P, 1), [1] * P, [1] * P, self.group).view(P)
        # SYNC: split sizes of the row all-to-all must be host ints (one copy for both).
        send_splits, recv_splits = torch.stack([send_P, recv_P]).tolist()
        pairs_N2 = torch.nonzero_static(in_rank_TP.t(), size=sum(send_splits))  # (rank, token), rank-major
        dest_N, send_N = pairs_N2[:, 0], pairs_N2[:, 1]
        ids_NK = ids_TK[send_N]
        here_NK = kept_TK[send_N] & (ids_NK // e == dest_N[:, None])
        local_NK = torch.where(here_NK, ids_NK % e, -1)
        meta_dtype = torch.promote_types(w_TK.dtype, torch.float32)
        meta_NK2 = torch.cat([local_NK.to(meta_dtype), w_TK[send_N].to(meta_dtype)], dim=1)
        x_MH = exchange_rows(x_TH[send_N], recv_splits, send_splits, self.group, self.comm_turns)
        meta_MK2 = exchange_rows(meta_NK2, recv_splits, send_splits, self.group)
        ids_MK = meta_MK2[:, :K].long()
        w_MK = meta_MK2[:, K:].to(w_TK.dtype)
        return x_MH, ids_MK, w_MK, _Layout(send_N, send_splits, recv_splits, T)

    def dispatch_fp8(
        self, x_fp8: Any, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, _Layout]:
        """``dispatch`` of an ``Fp8Tensor [T, H]``: data and scales packed in one ``uint8`` row each."""
        H = x_fp8.data.shape[-1]
        packed_MB, ids_MK, w_MK, layout = self.dispatch(pack_rows(x_fp8), ids_TK, w_TK, num_experts)
        return unpack_rows(packed_MB, H, (x_fp8.recipe, x_fp8.fmt, False)), ids_MK, w_MK, layout

    def _sum_back(self, rows_MX: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """Rows back to their source ranks, summed into the source tokens (fp32 at least)."""
        back_NX = exchange_rows(rows_MX, layout.send_splits, layout.recv_splits, self.group, self.comm_turns)
        acc_dtype = torch.promote_types(rows_MX.dtype, torch.float32)
        out_TX = torch.zeros((layout.num_tokens, *rows_MX.shape[1:]), dtype=acc_dtype, device=rows_MX.device)
        out_TX.index_add_(0, layout.send_N, back_NX.to(acc_dtype))
        return out_TX.to(rows_MX.dtype)

    def combine(self, y_MH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self._sum_back(y_MH, layout)

    def dispatch_again(self, grad_TH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return exchange_rows(grad_TH[layout.send_N], layout.recv_splits, layout.send_splits, self.group, self.comm_turns)

    def combine_grads(
        self, grad_x_MH: torch.Tensor, grad_w_MK: torch.Tensor, layout: _Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # a slot's weight gradient is non-zero only on the rank holding its expert: the sum is exact
        return self._sum_back(grad_x_MH, layout), self._sum_back(grad_w_MK, layout)
