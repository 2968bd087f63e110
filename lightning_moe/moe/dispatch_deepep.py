"""DeepEP token dispatcher (normal mode): the same contract as ``AllToAllDispatcher``.

Legend: T tokens, H hidden, K slots per token, E experts in total, P ranks of the EP group,
e = E/P local experts, M tokens this rank receives (each once, whatever the number of its slots
that land here), R rows this rank's experts process (the received slots that are local).

DeepEP sends each token once per destination *rank* (not once per slot) over NVLink/RDMA with its
own kernels, and hands back the received tokens with their top-k ids made local (``-1`` for slots
owned by another rank) and weights. Stages of ``dispatch``:

1. layout (DeepEP): tokens per rank and per expert, and which rank gets which token.
2. dispatch (DeepEP): ``x_MH``, ``ids_MK`` (local, ``-1`` elsewhere), ``w_MK``. Autograd: the
   backward is DeepEP's combine of the gradient (and of the weights' gradient).
3. permute (local): the received slots sorted by local expert, ``-1`` slots dropped (``x_RH``).

Stages of ``combine``: gather-sum of the rows back to the received tokens over their K slots
(weighted unless the experts applied the weight), then DeepEP's combine sums the partial outputs
of every rank into the source tokens (backward: a dispatch of the gradient with the cached layout).

``deep_ep`` is imported when the dispatcher is built: it is an optional accelerator (see the
project README for building it from source). It needs bf16 activations on CUDA; ``buffer`` may be
any object with DeepEP's ``Buffer`` methods (the CPU tests pass a gloo stand-in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch import DispatchedTokens, row_weights
from lightning_moe.moe.dispatch_ep import ExpertParallelDispatcher
from lightning_moe.ops.permute import Permutation, build_permutation, permute_rows, unpermute_sum

__all__ = ["DeepEPDispatcher", "DeepEPHandle", "make_deep_ep_buffer"]


def make_deep_ep_buffer(group: ProcessGroup, num_nvl_bytes: int = 1 << 30, num_rdma_bytes: int = 0) -> Any:
    """A ``deep_ep.Buffer`` over ``group``, or a clear error naming how to get DeepEP."""
    try:
        import deep_ep  # type: ignore[import-not-found]
    except ImportError as err:
        raise ImportError(
            "DeepEPDispatcher: the optional package deep_ep is not importable "
            f"({err}); build it from source on the GPU machine (PyPI's sdist lacks its headers), or use "
            "dispatcher='alltoall'."
        ) from err
    return deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)


@dataclass(frozen=True)
class DeepEPHandle:
    perm: Permutation  # local sort of the received slots by local expert
    weights_MK: torch.Tensor  # routing weights of the received tokens' slots (0 where not local)
    comm: Any  # DeepEP's communication handle (layout of the exchange)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, buffer: Any, num_experts: int, box: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids_TK, num_experts)
        x_MH, ids_MK, w_MK, counts, comm, _ = buffer.dispatch(
            x_TH,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids_TK,
            topk_weights=w_TK,
        )
        box["comm"], box["counts"] = comm, counts
        ctx.buffer, ctx.comm = buffer, comm
        ctx.mark_non_differentiable(ids_MK)
        return x_MH, ids_MK, w_MK

    @staticmethod
    def backward(ctx: Any, grad_x_MH: torch.Tensor, _grad_ids: Any, grad_w_MK: torch.Tensor):  # type: ignore[override]
        grad_x_TH, grad_w_TK, _ = ctx.buffer.combine(grad_x_MH.contiguous(), ctx.comm, topk_weights=grad_w_MK)
        return grad_x_TH, None, grad_w_TK, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_MH: torch.Tensor, buffer: Any, comm: Any) -> torch.Tensor:  # type: ignore[override]
        y_TH, _, _ = buffer.combine(y_MH.contiguous(), comm)
        ctx.buffer, ctx.comm = buffer, comm
        return y_TH

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor):  # type: ignore[override]
        grad_MH = ctx.buffer.dispatch(grad_TH.contiguous(), handle=ctx.comm)[0]
        return grad_MH, None, None


class DeepEPDispatcher(ExpertParallelDispatcher):
    """Experts sharded over ``ep_group``; tokens travel by DeepEP's dispatch/combine kernels.

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group.
        etp_group: must be ``None`` or of size 1 (DeepEP exchanges whole rows).
        buffer: a ``deep_ep.Buffer`` over ``ep_group``; default: one built by
            :func:`make_deep_ep_buffer`.
    """

    def __init__(
        self,
        num_experts: int,
        *,
        ep_group: ProcessGroup,
        etp_group: ProcessGroup | None = None,
        buffer: Any | None = None,
    ) -> None:
        super().__init__(num_experts, ep_group=ep_group, etp_group=etp_group)
        if self.etp_group is not None:
            raise ValueError(
                f"DeepEPDispatcher: etp={etp_group.size()} is not supported (DeepEP exchanges whole rows); "  # type: ignore[union-attr]
                "use etp=1 or dispatcher='alltoall'."
            )
        self.buffer = buffer if buffer is not None else make_deep_ep_buffer(ep_group)
        self._is_deep_ep = type(self.buffer).__module__.startswith("deep_ep")

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, DeepEPHandle]:
        self._reject_padding(capacity)
        if self._is_deep_ep and x_TH.dtype != torch.bfloat16:
            raise ValueError(
                f"DeepEPDispatcher: activations are {x_TH.dtype}; DeepEP's normal kernels move bfloat16 rows. "
                "Train in bf16 (precision='bf16-true' or 'bf16-mixed') or use dispatcher='alltoall'."
            )
        box: dict = {}
        weights_TK = topk_weights_TK.float() if self._is_deep_ep else topk_weights_TK  # DeepEP takes fp32
        x_MH, ids_MK, w_MK = _Dispatch.apply(
            x_TH, topk_ids_TK.long().contiguous(), weights_TK.contiguous(), self.buffer, self.num_experts, box
        )
        perm = build_permutation(ids_MK, self.num_local_experts, None)
        x_RH = permute_rows(x_MH, perm)
        w_R = row_weights(w_MK, perm)
        handle = DeepEPHandle(perm, w_MK, box["comm"])
        return DispatchedTokens(x_RH, perm.tokens_per_expert_E, w_R), handle

    def combine(self, y_RH: torch.Tensor, handle: DeepEPHandle, weighted: bool) -> torch.Tensor:
        weights_MK = handle.weights_MK if weighted else None
        y_MH = unpermute_sum(y_RH, handle.perm, weights_MK)
        return _Combine.apply(y_MH, self.buffer, handle.comm)

    def __repr__(self) -> str:
        return (
            f"DeepEPDispatcher(num_experts={self.num_experts}, ep={self.ep_size}, "
            f"local_experts={self.num_local_experts}, buffer={type(self.buffer).__name__})"
        )
