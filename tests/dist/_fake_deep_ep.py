"""A stand-in for ``deep_ep.Buffer`` (normal mode, intranode) over torch.distributed, for CPU tests.

It follows DeepEP's documented contract, not its kernels:

* ``get_dispatch_layout(topk_idx, E)`` -> tokens per rank, ``None`` (no RDMA ranks), tokens per
  expert, ``is_token_in_rank [T, P]``, event;
* ``dispatch(x, topk_idx=..., topk_weights=..., ...)`` sends each token once to every rank that
  owns one of its experts (tokens in order, source ranks in order) and returns the received
  ``x``, their top-k ids made local to the receiving rank (``-1`` for slots owned elsewhere),
  their weights, the per-local-expert counts (a list), a handle and an event;
  ``dispatch(x, handle=h)`` repeats the exchange of ``h`` for new rows (the backward of combine);
  ``x`` may be DeepEP's FP8 pair ``(float8_e4m3fn [T, H], fp32 scales [T, H/128])`` (checked
  as the library checks it: H a multiple of 128, contiguous), received as such a pair;
* ``combine(x, handle, topk_weights=None)`` sends every received row back and sums the rows of a
  token over the ranks it went to (and the weights likewise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Layout:
    send_index: torch.Tensor  # token of each sent row, destination ranks in order
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class FakeDeepEPBuffer:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.num_ranks = group.size()
        self.rank = group.rank()
        self.calls: dict[str, int] = {"layout": 0, "dispatch": 0, "fp8_dispatch": 0, "cached_dispatch": 0, "combine": 0}

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[Any, ...]:
        self.calls["layout"] += 1
        e = num_experts // self.num_ranks
        owner_TK = torch.where(topk_idx >= 0, topk_idx // e, -1)
        in_rank_TP = torch.stack([(owner_TK == p).any(1) for p in range(self.num_ranks)], dim=1)
        per_expert = torch.stack([(topk_idx == g).sum() for g in range(num_experts)]).int()
        return in_rank_TP.sum(0).int(), None, per_expert, in_rank_TP, None

    def _exchange(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        rows = rows.contiguous()
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, out_splits, in_splits, group=self.group)
        return out

    def dispatch(
        self,
        x: torch.Tensor,
        handle: _Layout | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[Any, ...]:
        if handle is not None:  # cached layout: rows only
            self.calls["cached_dispatch"] += 1
            recv = self._exchange(x[handle.send_index], handle.recv_splits, handle.send_splits)
            return recv, None, None, None, None, None
        self.calls["dispatch"] += 1
        assert is_token_in_rank is not None and topk_idx is not None and topk_weights is not None
        assert topk_idx.dtype == torch.int64 and topk_weights.is_floating_point()
        scales = None
        if isinstance(x, tuple):  # FP8 rows: (e4m3 data [T, H], fp32 scales [T, H / 128])
            self.calls["fp8_dispatch"] += 1
            x, scales = x
            assert x.dtype == torch.float8_e4m3fn and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)
            assert x.shape[1] % 128 == 0, x.shape
            assert scales.dtype == torch.float32 and scales.is_contiguous(), scales.dtype
            assert tuple(scales.shape) == (x.shape[0], x.shape[1] // 128), (scales.shape, x.shape)
        P, T = self.num_ranks, x.shape[0]
        e = int(num_tokens_per_expert.numel()) // P  # type: ignore[union-attr]
        index = [torch.nonzero(is_token_in_rank[:, p]).flatten() for p in range(P)]
        send_index = torch.cat(index)
        send_splits = [int(i.numel()) for i in index]
        counts = torch.tensor(send_splits, dtype=torch.long)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_splits = recv_counts.tolist()
        local_ids = torch.cat(
            [torch.where(topk_idx[i] // e == p, topk_idx[i] - p * e, -1) for p, i in enumerate(index)]
        )
        local_ids = torch.where(topk_idx[send_index] >= 0, local_ids, -1)
        if scales is None:
            recv_x = self._exchange(x[send_index], recv_splits, send_splits)
        else:  # gloo moves no float8: the bytes travel as uint8
            data = self._exchange(x.view(torch.uint8)[send_index], recv_splits, send_splits).view(x.dtype)
            recv_x = (data, self._exchange(scales[send_index], recv_splits, send_splits))
        recv_ids = self._exchange(local_ids, recv_splits, send_splits)
        recv_w = self._exchange(topk_weights[send_index], recv_splits, send_splits)
        per_local_expert = [int((recv_ids == j).sum()) for j in range(e)]
        layout = _Layout(send_index, send_splits, recv_splits, T)
        return recv_x, recv_ids, recv_w, per_local_expert, layout, None

    def combine(
        self, x: torch.Tensor, handle: _Layout, topk_weights: torch.Tensor | None = None, **_: Any
    ) -> tuple[Any, ...]:
        self.calls["combine"] += 1
        back = self._exchange(x, handle.send_splits, handle.recv_splits)
        out = x.new_zeros((handle.num_tokens, *x.shape[1:])).index_add_(0, handle.send_index, back)
        weights = None
        if topk_weights is not None:
            back_w = self._exchange(topk_weights, handle.send_splits, handle.recv_splits)
            weights = topk_weights.new_zeros((handle.num_tokens, *topk_weights.shape[1:]))
            weights.index_add_(0, handle.send_index, back_w)
        return out, weights, None


class FakeHybridEPBuffer:
    """A stand-in for ``deep_ep.HybridEPBuffer`` built on :class:`FakeDeepEPBuffer`'s exchange.

    ``dispatch(hidden=, routing_map=, probs=)`` (``[T, E]``) -> received tokens, their probabilities over
    the local experts ``[M, e]``, ``None`` (no fp8 scales) and a handle whose fifth entry is the
    local routing map ``[M, e]``; ``dispatch(hidden=, handle=, num_of_experts=)`` repeats the exchange (the
    library asserts ``num_of_experts`` whenever no routing map is given);
    ``combine(hidden=, probs=, handle=)`` -> summed tokens and probabilities dense over ``[T, E]``.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, hidden: int, max_tokens: int) -> None:
        self.inner = FakeDeepEPBuffer(group)
        self.num_experts = num_experts
        self.local = num_experts // group.size()
        self.rank = group.rank()
        self.built_for = (hidden, max_tokens)

    def dispatch(
        self,
        hidden: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        handle: tuple | None = None,
        num_of_experts: int | None = None,
        **_: Any,
    ) -> tuple[Any, ...]:
        assert hidden.shape[0] <= self.built_for[1] and hidden.shape[1] == self.built_for[0]
        if handle is not None:
            assert routing_map is not None or num_of_experts == self.num_experts
            return self.inner.dispatch(hidden, handle=handle[5])[0], None, None, handle
        assert routing_map is not None and routing_map.dtype == torch.bool and probs is not None
        experts = torch.arange(self.num_experts)
        topk_idx = torch.where(routing_map, experts, -1)  # every expert a column: [T, E]
        topk_weights = probs
        per_rank, _, per_expert, in_rank, _ = self.inner.get_dispatch_layout(topk_idx, self.num_experts)
        x, ids, w, _, layout, _ = self.inner.dispatch(
            hidden, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights
        )
        local_map = torch.stack([(ids == j).any(1) for j in range(self.local)], dim=1)
        probs = torch.zeros(ids.shape[0], self.local, dtype=w.dtype)
        for k in range(ids.shape[1]):
            slot = ids[:, k]
            rows = torch.nonzero(slot >= 0).flatten()
            probs[rows, slot[rows]] += w[rows, k]
        num_tokens = torch.tensor(ids.shape[0])
        return x, probs, None, (None, None, None, num_tokens, local_map, layout, hidden.shape[0])

    def combine(self, hidden: torch.Tensor, probs: torch.Tensor | None = None, handle: tuple | None = None) -> tuple:
        assert handle is not None
        layout = handle[5]
        out = self.inner.combine(hidden, layout)[0]
        if probs is None:
            return out, None
        dense = probs.new_zeros((probs.shape[0], self.num_experts))
        dense[:, self.rank * self.local : (self.rank + 1) * self.local] = probs
        return out, self.inner.combine(dense, layout)[0]
