"""All-gather token dispatcher: every EP rank sees every token of its EP group.

Legend: T tokens on this rank, G tokens gathered over the EP group, H hidden, K slots per token,
E experts in total, P ranks of the EP group, e = E/P local experts, R rows for local experts.

Better than all-to-all for small EP or large K (no count exchange per expert, one collective
each way, no regroup). Stages of ``dispatch``:

1. AG(EP) of the token counts (# SYNC: gathered sizes to the host), then AG(EP) of the tokens
   ``x_TH``, the top-k ids and the top-k weights (uneven rows allowed).
2. keep (local): slots whose expert is one of this rank's, renumbered to local ids; others -1.
3. permute (local) of the gathered tokens by local expert.
4. ETP only: ``copy_to_group(ETP)`` (backward all-reduces the partial input gradients).

Stages of ``combine``:

1. ETP only: all-reduce(ETP) of the partial ``w2`` outputs.
2. gather-sum (local) into the gathered token order (zero for tokens with no local expert).
3. RS(EP): sum the partial outputs over the EP group and keep this rank's tokens.

Backward of the all-gather is the reduce-scatter and vice versa, so gradients of the tokens and
of the routing weights are summed over the EP ranks that used them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_moe.moe.dispatch.base import DispatchedTokens, fp8_rows_of, row_weights
from lightning_moe.moe.dispatch.comm import all_gather_rows, reduce_scatter_rows
from lightning_moe.moe.dispatch.ep import ExpertParallelDispatcher
from lightning_moe.moe.dispatch.etp_rows import collect_from_etp, share_over_etp
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, unpermute_sum

__all__ = ["AllGatherDispatcher", "AllGatherHandle"]


@dataclass(frozen=True)
class AllGatherHandle:
    perm: Permutation  # local-expert sort of the gathered slots
    weights_GK: torch.Tensor  # gathered routing weights (differentiable)
    rows: list[int]  # [P] tokens contributed by each EP rank


class AllGatherDispatcher(ExpertParallelDispatcher):
    """Experts sharded over ``ep_group``; tokens all-gathered, outputs reduce-scattered.

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group (required).
        etp_group: the expert-tensor-parallel group, ``None`` when ETP is 1.
    """

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, AllGatherHandle]:
        self._reject_padding(capacity)
        fp8_rows_of(self)  # no FP8 rows here (capability False): a set fp8_rows is refused, naming the fix
        P, e = self.ep_size, self.num_local_experts
        num_T = torch.tensor([x_TH.shape[0]], dtype=torch.long, device=x_TH.device)
        sizes_P = torch.empty(P, dtype=torch.long, device=x_TH.device)
        dist.all_gather_into_tensor(sizes_P, num_T, group=self.ep_group)
        rows = sizes_P.tolist()  # SYNC: gathered token counts size the buffers
        x_GH = all_gather_rows(x_TH, rows, self.ep_rank, self.ep_group)
        ids_GK = all_gather_rows(topk_ids_TK, rows, self.ep_rank, self.ep_group)
        weights_GK = all_gather_rows(topk_weights_TK, rows, self.ep_rank, self.ep_group)

        first = self.ep_rank * e
        mine_GK = (ids_GK >= first) & (ids_GK < first + e)
        local_ids_GK = torch.where(mine_GK, ids_GK - first, torch.full_like(ids_GK, -1))
        perm = build_permutation(local_ids_GK, e, None)
        x_RH = permute_rows(x_GH, perm)
        w_R = row_weights(weights_GK, perm)
        x_RH, _, w_R, _, _ = share_over_etp(x_RH, None, w_R, perm.tokens_per_expert_E, self.etp_group, False)
        return DispatchedTokens(x_RH, perm.tokens_per_expert_E, w_R), AllGatherHandle(perm, weights_GK, rows)

    def combine(self, y_RH: torch.Tensor, handle: AllGatherHandle, weighted: bool) -> torch.Tensor:
        y_RH = collect_from_etp(y_RH, None, self.etp_group)
        y_GH = unpermute_sum(y_RH, handle.perm, handle.weights_GK if weighted else None)
        return reduce_scatter_rows(y_GH, handle.rows, self.ep_rank, self.ep_group)

    def __repr__(self) -> str:
        etp = 1 if self.etp_group is None else self.etp_group.size()
        return (
            f"AllGatherDispatcher(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"local_experts={self.num_local_experts}, etp={etp})"
        )
