"""DeepEP (normal mode) as a :class:`~lightning_moe.moe.dispatch.flex.TokenExchange`.

DeepEP's ``Buffer``: ``get_dispatch_layout`` (tokens per rank and expert, which rank gets which
token), ``dispatch`` (received tokens with their top-k ids made local, ``-1`` elsewhere, and
weights; fp32 weights, int64 ids, bf16 rows), ``combine`` (sum back into the source tokens, and the
weights likewise), ``dispatch(handle=...)`` (the cached layout again). ``deep_ep`` is optional and
imported when a buffer is built; the CPU tests pass a stand-in with the same methods.

FP8 rows (``dispatch_fp8``): DeepEP's normal-mode dispatch also takes ``x`` as a pair
``(float8_e4m3fn [T, H], fp32 scales [T, H/128])`` and returns the received rows as such a pair:
the blockwise (1, 128) e4m3 recipe with ``H`` a multiple of 128. Other recipes, formats or widths
are refused before any communication, with the fix named.
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
    carries_fp8_rows = True  # blockwise (1, 128) e4m3 rows, H a multiple of 128

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.needs_bf16 = type(buffer).__module__.startswith("deep_ep")

    def dispatch(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Layout]:
        return self._dispatch(x_TH, ids_TK, w_TK, num_experts)

    def dispatch_fp8(
        self, x_fp8: Any, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, _Layout]:
        """``dispatch`` of an ``Fp8Tensor [T, H]`` as DeepEP's ``(data, scales)`` pair."""
        from lightning_moe.ops.fp8.quantize import Fp8Tensor

        H = x_fp8.data.shape[-1]
        if x_fp8.recipe != "blockwise" or x_fp8.tile != (1, 128) or x_fp8.fmt != "e4m3" or H % 128:
            raise ValueError(
                f"DeepEPExchange: DeepEP moves FP8 rows as e4m3 data with one fp32 scale per 128 columns; got "
                f"recipe={x_fp8.recipe!r}, fmt={x_fp8.fmt!r}, hidden size {H}. Use Fp8Config(recipe='blockwise') "
                "with a hidden size that is a multiple of 128, or dispatcher='alltoall' / 'alltoall_dedup' (any "
                "recipe), or Fp8Config(dispatch=False)."
            )
        pair = (x_fp8.data.contiguous(), x_fp8.scale.float().contiguous())
        (data_MH, scale_MS), ids_MK, w_MK, layout = self._dispatch(pair, ids_TK, w_TK, num_experts)
        q = Fp8Tensor(data_MH, scale_MS, x_fp8.recipe, x_fp8.fmt, -1, x_fp8.tile)
        return q, ids_MK, w_MK, layout

    def _dispatch(
        self, x: Any, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, _Layout]:
        weights_TK = w_TK.float() if self.needs_bf16 else w_TK  # DeepEP's kernels take fp32 weights
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids_TK, num_experts)
        x_MH, ids_MK, w_MK, _counts, handle, _ = self.buffer.dispatch(
            x,
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
