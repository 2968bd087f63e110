"""Plain-PyTorch references for the attention tests: packed rows, each document attended alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["B", "D", "DOCS", "N", "NK", "S", "grads", "inputs", "per_document", "reference"]

# two rows of packed documents: lengths 4, 1, 6, 2 and 13 (one document filling the row)
DOCS = torch.tensor([[0] * 4 + [1] + [2] * 6 + [3] * 2, [7] * 13])
B, N, NK, S, D = 2, 4, 2, 13, 8


def reference(q_NSD: torch.Tensor, k_NSD: torch.Tensor, v_NSD: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of one sequence written out, kv heads repeated per query group."""
    n, s = q_NSD.shape[0], q_NSD.shape[1]
    k_NSD = k_NSD.repeat_interleave(n // k_NSD.shape[0], dim=0)
    v_NSD = v_NSD.repeat_interleave(n // v_NSD.shape[0], dim=0)
    scores = q_NSD @ k_NSD.transpose(-1, -2) / q_NSD.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v_NSD


def inputs(seed: int = 0, b: int = B) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, N, S, D, generator=g) * 2  # large enough that attention is far from uniform
    k = torch.randn(b, NK, S, D, generator=g) * 2
    v = torch.randn(b, NK, S, D, generator=g)
    c = torch.randn(b, N, S, D, generator=g)
    return q, k, v, c


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(q)
    for b in range(docs.shape[0]):
        for doc in docs[b].unique():
            idx = (docs[b] == doc).nonzero().flatten()
            out[b, :, idx] = reference(q[b, :, idx], k[b, :, idx], v[b, :, idx])
    return out


def grads(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of ``fn(q, k, v)`` for the loss ``(out * c).sum()``."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad((out * c).sum(), leaves))
