"""The shape rule every causal-attention entry point checks its queries, keys and values against.

Legend: B batch, N query heads, Nk key/value heads, Sq query length, Sk key length, D head dim,
Dv value head dim. Queries ``[B, N, Sq, D]``, keys ``[B, Nk, Sk, D]``, values ``[B, Nk, Sk, Dv]``,
with N a multiple of Nk (grouped-query attention).
"""

from __future__ import annotations

import torch

__all__ = ["check_attention_shapes"]


def check_attention_shapes(
    owner: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = False
) -> None:
    """``ValueError`` naming ``owner`` and the shapes unless ``q``, ``k``, ``v`` fit the rule above;
    ``same_length``: keys must also be as many as queries (this rank's own tokens)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{owner}: q, k, v must be [B, N, S, D]; got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    B, N, Sq, D = q.shape
    fits = k.shape[0] == B and k.shape[3] == D and v.shape[:3] == k.shape[:3]
    if not fits or (same_length and k.shape[2] != Sq):
        length = ", as many keys as queries" if same_length else ""
        raise ValueError(
            f"{owner}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: batch, key heads and key "
            f"length must agree{length}, and k's head dim must equal q's."
        )
    if k.shape[1] == 0 or N % k.shape[1]:
        raise ValueError(f"{owner}: {N} query heads are not a multiple of {k.shape[1]} key/value heads.")
