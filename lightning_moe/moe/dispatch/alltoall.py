"""All-to-all token dispatcher: experts sharded over the expert-parallel (EP) group.

Legend: T tokens, H hidden, K slots per token, E experts in total, P ranks of the EP group,
e = E/P local experts, N rows this rank sends (kept slots), R rows this rank's experts process.

Expert ``g`` lives on EP rank ``g // e`` as local expert ``g % e``. Stages of ``dispatch``:

1. permute (local): stable sort of the (token, slot) pairs by global expert id, so the rows
   for EP rank p are one contiguous block, ordered by its local experts (``x_NH``, ``w_N``).
2. A2A(EP) of the counts ``[P, e]``: how many rows this rank sends to each expert of each rank,
   and how many it receives from each source rank for each local expert.
3. # SYNC: the split sizes go to the host (one device→host copy per layer).
4. A2A(EP) of the rows and of their routing weights, uneven splits (autograd: the backward is
   the reverse all-to-all).
5. regroup (local): received rows are source-major ``[src][expert]``; a stable sort makes them
   expert-major ``[expert][src]`` for the grouped GEMM (``reorder_rows``: its backward gathers
   through the inverse order instead of an atomic scatter-add).
6. ETP only: ``copy_to_group(ETP)`` marks the rows as identical over the expert-tensor-parallel
   group (backward all-reduces their gradient, which each ETP rank computes from its F slice).
   With ``etp_sequence_parallel`` the ETP ranks hold different tokens (sequence parallel): the
   rows are all-gathered over ETP instead (``gather_expert_rows``), so each ETP rank computes its
   F slice for the rows of the whole ETP group.

Stages of ``combine`` (the reverse):

1. ETP only: all-reduce(ETP) of the partial outputs of the row-parallel ``w2`` (with
   ``etp_sequence_parallel``: reduce-scatter(ETP), each rank keeping its own rows).
2. un-regroup (local) back to source-major.
3. A2A(EP) back to the source ranks, splits swapped.
4. gather-sum (local) into token order over the K slots (weighted unless the experts already
   applied the weight).

FP8 rows (``fp8_rows`` set, see ``moe/dispatch/base.py``): stage 1 quantizes ``x_TH`` once and
gathers the packed FP8 rows (data and scales in one ``uint8`` row, ``moe/dispatch/fp8_rows.py``);
stage 4 moves them in one all-to-all; stage 5 regroups data and scales by the same order; with ETP
stage 6 marks the placeholder ``x_RH`` like the activation-dtype rows (each ETP rank quantized
the same tokens to the same bits). The gradient goes back in the activation dtype through the
same inverse regroup, reverse all-to-all and gather-sum as the activation-dtype rows'. With
``etp_sequence_parallel`` the FP8 rows are all-gathered over ETP packed
(``fp8_rows.gather_expert_fp8_rows``), the placeholder's gradient reduce-scattered back.

Overlap (``comm_turns`` set, by a pipeline whose schedule overlaps one micro-batch's forward with
another's backward): the row all-to-alls of stages 4 (dispatch) and 3 (combine), FP8 rows
included, and their backward's, are issued asynchronously and the turn handed to the other
micro-batch while they are in flight (``moe/dispatch/turns.py``).

The dispatcher holds only its groups; it is not an ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.base import DispatchedTokens, DispatcherCapabilities, fp8_rows_of, row_weights
from lightning_moe.moe.dispatch.comm import ExpertRowsLayout, all_to_all_rows, check_etp_sequence_parallel, exchange_rows
from lightning_moe.moe.dispatch.ep import ExpertParallelDispatcher
from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.moe.dispatch.etp_rows import collect_from_etp, share_over_etp
from lightning_moe.moe.dispatch.fp8_rows import (
    dispatch_fp8_rows,
    gather_rows,
    pack_rows,
    unpack_rows,
)
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, reorder_rows, unpermute_sum

__all__ = ["AllToAllDispatcher", "AllToAllHandle"]


@dataclass(frozen=True)
class AllToAllHandle:
    perm: Permutation  # local sort of this rank's slots by global expert
    topk_weights_TK: torch.Tensor
    send_splits: list[int]  # [P] rows sent to each EP rank
    recv_splits: list[int]  # [P] rows received from each EP rank
    unregroup_R: torch.Tensor  # expert-major row -> source-major position (inverse of the regroup)
    regroup_R: torch.Tensor  # source-major row -> expert-major position (the regroup itself)
    etp_rows: ExpertRowsLayout | None = None  # the ETP all-gather (etp_sequence_parallel only)


@dataclass(frozen=True)
class _AllToAllRoute:
    """FP8 rows: gathered and packed, A2A(EP), regrouped; the gradient the reverse way."""

    perm: Permutation
    send_splits: list[int]
    recv_splits: list[int]
    regroup_R: torch.Tensor
    unregroup_R: torch.Tensor
    group: ProcessGroup
    turns: CommTurns | None = None

    def send(self, q_TH: Any) -> Any:
        packed_NB = pack_rows(q_TH, self.perm.src_token_R)
        packed_MB = exchange_rows(packed_NB, self.recv_splits, self.send_splits, self.group, self.turns)
        return gather_rows(unpack_rows(packed_MB, q_TH.data.shape[-1], (q_TH.recipe, q_TH.fmt, False)), self.regroup_R)

    def send_back(self, grad_RH: torch.Tensor) -> torch.Tensor:
        grad_MH = grad_RH.index_select(0, self.unregroup_R)
        grad_NH = exchange_rows(grad_MH, self.send_splits, self.recv_splits, self.group, self.turns)
        return unpermute_sum(grad_NH, self.perm)  # the gradient of permute_rows


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Experts sharded over ``ep_group``; tokens travel by uneven all-to-all.

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group (required; never WORLD by default).
        etp_group: the expert-tensor-parallel group when each expert's F dimension is sharded
            (``None``: ETP is 1). Its ranks must hold identical tokens (they are tensor-parallel
            replicas of each other); ``parallel/parallelize.py`` checks that.
        etp_sequence_parallel: the ETP ranks hold different tokens (sequence parallel in the
            dense TP region): the received rows are all-gathered over ``etp_group`` and the
            ``w2`` partial outputs reduce-scattered back, instead of all-reduced.

    Capabilities: FP8 rows (``fp8_rows``: quantized once, one all-to-all for data and scales).
    ``comm_turns``: set by a pipeline that overlaps micro-batches (module docstring).
    """

    capabilities = DispatcherCapabilities(carries_fp8_rows=True)
    fp8_rows = None  # (recipe, fmt, pow2_scales) when the layer's FP8 experts take FP8 rows
    comm_turns: CommTurns | None = None

    def __init__(
        self,
        num_experts: int,
        *,
        ep_group: dist.ProcessGroup,
        etp_group: dist.ProcessGroup | None = None,
        etp_sequence_parallel: bool = False,
    ) -> None:
        super().__init__(num_experts, ep_group=ep_group, etp_group=etp_group)
        self.etp_sequence_parallel = check_etp_sequence_parallel(type(self).__name__, etp_sequence_parallel)

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, AllToAllHandle]:
        self._reject_padding(capacity)
        spec = fp8_rows_of(self)
        P, e = self.ep_size, self.num_local_experts
        perm = build_permutation(topk_ids_TK, self.num_experts, None)
        w_N = row_weights(topk_weights_TK, perm)

        send_Pe = perm.tokens_per_expert_E.view(P, e).contiguous()
        recv_Pe = torch.empty_like(send_Pe)
        dist.all_to_all_single(recv_Pe, send_Pe, group=self.ep_group)
        # SYNC: split sizes of the row all-to-all must be host ints (one copy for both).
        splits = torch.stack([send_Pe.sum(1), recv_Pe.sum(1)]).tolist()
        send_splits, recv_splits = splits[0], splits[1]

        w_R = all_to_all_rows(w_N.unsqueeze(-1), recv_splits, send_splits, self.ep_group).squeeze(-1)

        # received rows are [src][local expert]; sort stably by local expert -> [expert][src]
        local_ids = torch.arange(e, device=recv_Pe.device).repeat(P)
        expert_of_row_R = torch.repeat_interleave(local_ids, recv_Pe.reshape(-1))
        regroup_R = torch.argsort(expert_of_row_R, stable=True)
        unregroup_R = torch.empty_like(regroup_R)
        unregroup_R[regroup_R] = torch.arange(regroup_R.numel(), device=regroup_R.device)
        x_fp8 = None
        if spec is not None:
            route = _AllToAllRoute(perm, send_splits, recv_splits, regroup_R, unregroup_R, self.ep_group, self.comm_turns)
            x_RH, x_fp8 = dispatch_fp8_rows(x_TH, route, spec)
        else:
            x_NH = permute_rows(x_TH, perm)
            x_RH = all_to_all_rows(x_NH, recv_splits, send_splits, self.ep_group, self.comm_turns)
            x_RH = reorder_rows(x_RH, regroup_R, unregroup_R)
        w_R = reorder_rows(w_R, regroup_R, unregroup_R)
        tokens_per_expert_e = recv_Pe.sum(0)
        x_RH, x_fp8, w_R, tokens_per_expert_e, etp_rows = share_over_etp(
            x_RH, x_fp8, w_R, tokens_per_expert_e, self.etp_group, self.etp_sequence_parallel
        )
        handle = AllToAllHandle(perm, topk_weights_TK, send_splits, recv_splits, unregroup_R, regroup_R, etp_rows)
        return DispatchedTokens(x_RH, tokens_per_expert_e, w_R, x_fp8), handle

    def combine(self, y_RH: torch.Tensor, handle: AllToAllHandle, weighted: bool) -> torch.Tensor:
        y_RH = collect_from_etp(y_RH, handle.etp_rows, self.etp_group)
        y_RH = reorder_rows(y_RH, handle.unregroup_R, handle.regroup_R)
        y_NH = all_to_all_rows(y_RH, handle.send_splits, handle.recv_splits, self.ep_group, self.comm_turns)
        weights_TK = handle.topk_weights_TK if weighted else None
        return unpermute_sum(y_NH, handle.perm, weights_TK)

    def __repr__(self) -> str:
        etp = 1 if self.etp_group is None else self.etp_group.size()
        return (
            f"AllToAllDispatcher(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"local_experts={self.num_local_experts}, etp={etp}"
            + ("" if self.fp8_rows is None else f", fp8_rows={self.fp8_rows!r}")
            + ")"
        )
