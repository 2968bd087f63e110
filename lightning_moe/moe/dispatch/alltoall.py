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

Stages of ``combine`` (the reverse):

1. ETP only: all-reduce(ETP) of the partial outputs of the row-parallel ``w2``.
2. un-regroup (local) back to source-major.
3. A2A(EP) back to the source ranks, splits swapped.
4. gather-sum (local) into token order over the K slots (weighted unless the experts already
   applied the weight).

The dispatcher holds only its groups; it is not an ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_moe.moe.dispatch.base import DispatchedTokens, row_weights
from lightning_moe.moe.dispatch.comm import all_to_all_rows, copy_to_group, reduce_from_group
from lightning_moe.moe.dispatch.ep import ExpertParallelDispatcher
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


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Experts sharded over ``ep_group``; tokens travel by uneven all-to-all.

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group (required; never WORLD by default).
        etp_group: the expert-tensor-parallel group when each expert's F dimension is sharded
            (``None``: ETP is 1). Its ranks must hold identical tokens (they are tensor-parallel
            replicas of each other); ``parallel/parallelize.py`` checks that.
    """

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, AllToAllHandle]:
        self._reject_padding(capacity)
        P, e = self.ep_size, self.num_local_experts
        perm = build_permutation(topk_ids_TK, self.num_experts, None)
        x_NH = permute_rows(x_TH, perm)
        w_N = row_weights(topk_weights_TK, perm)

        send_Pe = perm.tokens_per_expert_E.view(P, e).contiguous()
        recv_Pe = torch.empty_like(send_Pe)
        dist.all_to_all_single(recv_Pe, send_Pe, group=self.ep_group)
        # SYNC: split sizes of the row all-to-all must be host ints (one copy for both).
        splits = torch.stack([send_Pe.sum(1), recv_Pe.sum(1)]).tolist()
        send_splits, recv_splits = splits[0], splits[1]

        x_RH = all_to_all_rows(x_NH, recv_splits, send_splits, self.ep_group)
        w_R = all_to_all_rows(w_N.unsqueeze(-1), recv_splits, send_splits, self.ep_group).squeeze(-1)

        # received rows are [src][local expert]; sort stably by local expert -> [expert][src]
        local_ids = torch.arange(e, device=recv_Pe.device).repeat(P)
        expert_of_row_R = torch.repeat_interleave(local_ids, recv_Pe.reshape(-1))
        regroup_R = torch.argsort(expert_of_row_R, stable=True)
        unregroup_R = torch.empty_like(regroup_R)
        unregroup_R[regroup_R] = torch.arange(regroup_R.numel(), device=regroup_R.device)
        x_RH = reorder_rows(x_RH, regroup_R, unregroup_R)
        w_R = reorder_rows(w_R, regroup_R, unregroup_R)
        if self.etp_group is not None:
            x_RH = copy_to_group(x_RH, self.etp_group)
            w_R = copy_to_group(w_R, self.etp_group)

        tokens_per_expert_e = recv_Pe.sum(0)
        handle = AllToAllHandle(perm, topk_weights_TK, send_splits, recv_splits, unregroup_R, regroup_R)
        return DispatchedTokens(x_RH, tokens_per_expert_e, w_R), handle

    def combine(self, y_RH: torch.Tensor, handle: AllToAllHandle, weighted: bool) -> torch.Tensor:
        if self.etp_group is not None:
            y_RH = reduce_from_group(y_RH, self.etp_group)
        y_RH = reorder_rows(y_RH, handle.unregroup_R, handle.regroup_R)
        y_NH = all_to_all_rows(y_RH, handle.send_splits, handle.recv_splits, self.ep_group)
        weights_TK = handle.topk_weights_TK if weighted else None
        return unpermute_sum(y_NH, handle.perm, weights_TK)

    def __repr__(self) -> str:
        etp = 1 if self.etp_group is None else self.etp_group.size()
        return (
            f"AllToAllDispatcher(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"local_experts={self.num_local_experts}, etp={etp})"
        )
