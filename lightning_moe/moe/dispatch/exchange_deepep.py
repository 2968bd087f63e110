"""DeepEP (normal mode) as a :class:`~lightning_moe.moe.dispatch.flex.TokenExchange`.

DeepEP's ``Buffer``: ``get_dispatch_layout`` (tokens per rank and expert, which rank gets which
token), ``dispatch`` (received tokens with their top-k ids made local, ``-1`` elsewhere, and
weights; fp32 weights, int64 ids, bf16 rows), ``combine`` (sum back into the source tokens, and the
weights likewise), ``dispatch(handle=...)`` (the cached layout again). ``deep_ep`` is optional and
imported when a buffer is built; the CPU tests pass a stand-in with the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

__all__ = ["DeepEPExchange", "make_deep_ep_buffer"]


def make_deep_ep_buffer(group: ProcessGroup, num_nvl_bytes: int = 1 << 30, num_rdma_bytes: int = 0) -> Any:
    """A ``deep_ep.Buffer`` over ``group``, or a clear error naming how to get DeepEP."""
    try:
        import deep_ep  # type: ignore[import-not-found]
    except ImportError as err:
        raise ImportError(
            f"DeepEP exchange: the optional package deep_ep is not importable ({err}); build it from source on "
            "the GPU machine (PyPI's sdist lacks its headers), or use dispatcher='alltoall'."
        ) from err
    return deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)


@dataclass(frozen=True)
class _Layout:
    handle: Any
    weight_dtype: torch.dtype


class DeepEPExchange:
    """Adapts a ``deep_ep.Buffer`` (or a stand-in with its methods) to the flex dispatcher."""

    name = "deepep"
    takes_any_expert_count = False

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.needs_bf16 = type(buffer).__module__.startswith("deep_ep")

    def dispatch(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Layout]:
        weights_TK = w_TK.float() if self.needs_bf16 else w_TK  # DeepEP's kernels take fp32 weights
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids_TK, num_experts)
        x_MH, ids_MK, w_MK, _counts, handle, _ = self.buffer.dispatch(
            x_TH,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids_TK,
            topk_weights=weights_TK,
        )
        return x_MH, ids_MK, w_MK, _Layout(handle, w_TK.dtype)

    def combine(self, y_MH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self.buffer.combine(y_MH, layout.handle)[0]

    def dispatch_again(self, grad_TH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self.buffer.dispatch(grad_TH, handle=layout.handle)[0]

    def combine_grads(
        self, grad_x_MH: torch.Tensor, grad_w_MK: torch.Tensor, layout: _Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights = grad_w_MK.float() if self.needs_bf16 else grad_w_MK
        grad_x_TH, grad_w_TK, _ = self.buffer.combine(grad_x_MH, layout.handle, topk_weights=weights)
        return grad_x_TH, grad_w_TK.to(layout.weight_dtype)
