"""TokenDataset: next-token windows of ``seq_len + 1`` tokens over a 1-D token stream."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["TokenDataset"]


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Next-token windows over a 1-D token stream.

    Item ``i`` is the window ``w = tokens[i*stride : i*stride + seq_len + 1]`` as
    ``{"input_ids": w[:-1], "labels": w[1:]}``, both int64 ``[seq_len]``, so
    ``labels[j] == input_ids[j + 1]``. The default ``stride=seq_len`` makes inputs
    non-overlapping and uses every token as a target exactly once (neighbouring windows share
    one boundary token). A trailing remainder shorter than a window is dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int | None = None) -> None:
        stride = seq_len if stride is None else stride
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            got = f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
            raise ValueError(f"TokenDataset: tokens has {got}; pass a 1-D integer tensor.")
        for name, value in (("seq_len", seq_len), ("stride", stride)):
            if value < 1:
                raise ValueError(f"TokenDataset: {name}={value} must be >= 1; use a positive int.")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"TokenDataset: {tokens.numel()} tokens but seq_len={seq_len} needs at least {seq_len + 1}; "
                "lower seq_len or supply more tokens."
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"TokenDataset: index {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        window = self.tokens[start : start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}
