"""Hybrid-EP (DeepEP's ``HybridEPBuffer``) as a :class:`~lightning_moe.moe.dispatch.flex.TokenExchange`.

**Experimental.** This adapter has not yet run against the real library on hardware; selecting it
(``dispatcher="hybridep"``) warns once per process. ``"deepep"`` and ``"alltoall_dedup"`` are the
tested exchanges.

Hybrid-EP routes by a dense map: ``dispatch(hidden=, routing_map=, probs=)`` (``[T, E]``, built here
so that dropped slots take no column) returns the
received tokens ``[M, H]``, their routing probabilities and a handle whose fifth entry is the
received tokens' local routing map ``[M, e]`` (bool); ``combine(hidden=, probs=, handle=)`` sums
them back into the source tokens (and the probabilities, dense over the experts). The buffer is
sized by the hidden size and the tokens per rank, so it is built at the first dispatch (and again
for a larger batch). Checked against a stand-in on CPU (tests/dist); on two H200 the library
(DeepEP's hybrid-ep branch, 1.2.1) built but its buffer constructor crashed (segmentation fault
inside ``hybrid_ep_cpp``), so this adapter has not run against the real library yet. Where the
library's probability layout is ``[M, E]`` rather than ``[M, e]``, the local columns are taken.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

__all__ = ["HybridEPExchange", "warn_hybrid_ep_experimental"]


@functools.cache
def warn_hybrid_ep_experimental() -> None:
    """Warn, once per process, that the Hybrid-EP exchange is experimental."""
    warnings.warn(
        "HybridEPExchange: dispatcher='hybridep' is experimental; it has not yet run against DeepEP's Hybrid-EP "
        "library on hardware (only against a CPU stand-in). Use dispatcher='deepep' or 'alltoall_dedup' for "
        "tested token exchange.",
        UserWarning,
        stacklevel=3,
    )


def _hybrid_ep_buffer_class() -> Any:
    try:
        import deep_ep  # type: ignore[import-not-found]
    except ImportError as err:
        raise ImportError(
            f"Hybrid-EP exchange: deep_ep is not importable ({err}); build DeepEP with Hybrid-EP from source on "
            "the GPU machine, or use dispatcher='alltoall'."
        ) from err
    for name in ("HybridEPBuffer", "HybridEpBuffer"):  # the class's name has changed between releases
        if hasattr(deep_ep, name):
            return getattr(deep_ep, name)
    raise ImportError(
        "Hybrid-EP exchange: this deep_ep has no HybridEPBuffer (it was built without Hybrid-EP); build DeepEP's "
        "Hybrid-EP branch from source, or use dispatcher='deepep' / 'alltoall'."
    )


@dataclass(frozen=True)
class _Layout:
    handle: Any
    ids_TK: torch.Tensor  # to turn the dense probability gradient back into [T, K]
    probs_width: int  # the library's probability columns: e (local) or E (global)
    received: int  # M, the tokens this rank received (the backward's dispatch needs no host sync)
    weight_dtype: torch.dtype


class HybridEPExchange:
    """Adapts ``HybridEpBuffer`` (or ``make_buffer(hidden, max_tokens)``, a stand-in) to the flex dispatcher.

    Experimental (not yet run on hardware): constructing one warns once per process.
    """

    name = "hybridep"
    takes_any_expert_count = False

    def __init__(self, group: ProcessGroup, num_experts: int, make_buffer: Any | None = None) -> None:
        warn_hybrid_ep_experimental()
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // group.size()
        self.needs_bf16 = make_buffer is None
        self._make = make_buffer
        self._library = _hybrid_ep_buffer_class() if make_buffer is None else None  # fails early, naming the fix
        self.buffer: Any = None
        self._capacity = (0, 0)  # (hidden, max tokens per rank) the buffer was built for

    def _buffer_for(self, hidden: int, tokens: int) -> Any:
        if self.buffer is None or self._capacity[0] != hidden or self._capacity[1] < tokens:
            if self._make is not None:
                self.buffer = self._make(hidden, tokens)
            else:
                self.buffer = self._library(
                    group=self.group,
                    hidden_dim=hidden,
                    max_num_of_tokens_per_rank=tokens,
                    num_local_experts=self.num_local_experts,
                )
            self._capacity = (hidden, tokens)
        return self.buffer

    def _local_probs(self, probs: torch.Tensor) -> torch.Tensor:
        if probs.shape[1] == self.num_local_experts:
            return probs
        start = self.group.rank() * self.num_local_experts
        return probs[:, start : start + self.num_local_experts]

    def dispatch(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Layout]:
        buffer = self._buffer_for(x_TH.shape[1], x_TH.shape[0])
        weights_TK = w_TK.float() if self.needs_bf16 else w_TK  # the library's probabilities are fp32
        # Dense routing built here rather than by the library: dropped slots (id -1) take no column.
        kept_TK = ids_TK >= 0
        columns_TK = ids_TK.clamp(min=0)
        T = ids_TK.shape[0]
        hits_TE = torch.zeros(T, num_experts, dtype=torch.int32, device=ids_TK.device)
        routing_map_TE = hits_TE.scatter_add_(1, columns_TK, kept_TK.int()) > 0
        probs_TE = weights_TK.new_zeros((T, num_experts)).scatter_add_(1, columns_TK, weights_TK * kept_TK)
        x_MH, probs, _scales, handle = buffer.dispatch(hidden=x_TH, routing_map=routing_map_TE, probs=probs_TE)
        local_map_Me = handle[4][: x_MH.shape[0]]
        e = self.num_local_experts
        ids_Me = torch.where(local_map_Me, torch.arange(e, device=local_map_Me.device), -1)
        w_Me = self._local_probs(probs).to(w_TK.dtype)
        w_Me = w_Me[: x_MH.shape[0]]
        return x_MH, ids_Me, w_Me, _Layout(handle, ids_TK, probs.shape[1], x_MH.shape[0], w_TK.dtype)

    def combine(self, y_MH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self.buffer.combine(hidden=y_MH, probs=None, handle=layout.handle)[0]

    def dispatch_again(self, grad_TH: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self.buffer.dispatch(
            hidden=grad_TH, handle=layout.handle, num_of_experts=self.num_experts, num_dispatched_tokens=layout.received
        )[0]

    def combine_grads(
        self, grad_x_MH: torch.Tensor, grad_w_Me: torch.Tensor, layout: _Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grad_probs = grad_w_Me.float() if self.needs_bf16 else grad_w_Me
        if layout.probs_width != self.num_local_experts:  # back to the library's [M, E] layout
            start = self.group.rank() * self.num_local_experts
            full = grad_probs.new_zeros((grad_probs.shape[0], layout.probs_width))
            full[:, start : start + self.num_local_experts] = grad_probs
            grad_probs = full
        grad_x_TH, grad_probs_TE = self.buffer.combine(hidden=grad_x_MH, probs=grad_probs, handle=layout.handle)
        ids_TK = layout.ids_TK
        grad_w_TK = grad_probs_TE.gather(1, ids_TK.clamp(min=0)) * (ids_TK >= 0)
        return grad_x_TH, grad_w_TK.to(layout.weight_dtype)
