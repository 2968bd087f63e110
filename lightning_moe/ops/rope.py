"""Rotary position embedding of attention heads (the rotate-half convention), with its own backward.

Legend: B batch, S sequence, N heads, D head dim (even), P table rows.

For a head row ``x = [x1 | x2]`` (halves of D) and the fp32 table rows ``c, s`` of its token::

    rope(x) = [x1 * c - x2 * s,  x2 * c + x1 * s]

computed in fp32 and rounded once to ``x``'s dtype. The tables are ``[S, D/2]`` (one for every batch
row) or ``[B, S, D/2]`` (per-token positions: packed documents, context-parallel shards).

On CUDA with the csrc extension (``ops/backend.py``) one kernel reads ``x`` once and writes the
result once, forward and backward; it equals the torch expression bit for bit (tests/gpu). Elsewhere
the torch expression runs, under autograd.
"""

from __future__ import annotations

import torch

from lightning_moe.ops.backend import csrc_extension

__all__ = ["check_rope_inputs", "kernel_tables", "rope", "rope_reference"]


def rope_reference(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The spec, in plain torch: ``x [B, S, N, D]``, tables ``[S, D/2]`` or ``[B, S, D/2]``."""
    cos_, sin_ = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    x1, x2 = x_BSND.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos_ - x2 * sin_, x2 * cos_ + x1 * sin_], dim=-1).to(x_BSND.dtype)


def kernel_tables(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as the csrc kernels read them: fp32 ``[P, D/2]``, P = S or B * S."""
    half = x_BSND.shape[-1] // 2
    return cos.float().reshape(-1, half).contiguous(), sin.float().reshape(-1, half).contiguous()


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSND: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ext = csrc_extension(x_BSND)
        ctx.save_for_backward(cos_PD, sin_PD)
        B, S, N, D = x_BSND.shape
        out = ext.rope(x_BSND.contiguous().view(B * S, N, D), cos_PD, sin_PD, False)
        return out.view(B, S, N, D)

    @staticmethod
    def backward(ctx, grad_BSND: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        cos_PD, sin_PD = ctx.saved_tensors
        ext = csrc_extension(grad_BSND)
        B, S, N, D = grad_BSND.shape
        grad = ext.rope(grad_BSND.contiguous().view(B * S, N, D), cos_PD, sin_PD, True)
        return grad.view(B, S, N, D), None, None


def check_rope_inputs(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise naming the shape unless ``x`` is ``[B, S, N, D]`` (D even) with ``[S, D/2]`` or ``[B, S, D/2]`` tables."""
    if x_BSND.dim() != 4 or x_BSND.shape[-1] % 2:
        raise ValueError(f"rope: x has shape {tuple(x_BSND.shape)}; expected [B, S, N, D] with an even head dim D.")
    B, S, _, D = x_BSND.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) not in ((S, D // 2), (B, S, D // 2)):
            raise ValueError(
                f"rope: {name} has shape {tuple(t.shape)}; expected [S, D/2] = [{S}, {D // 2}] or "
                f"[B, S, D/2] = [{B}, {S}, {D // 2}] for x of shape {tuple(x_BSND.shape)}."
            )


def rope(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the heads of ``x [B, S, N, D]`` by the tables ``cos, sin`` (``[S, D/2]`` or ``[B, S, D/2]``)."""
    check_rope_inputs(x_BSND, cos, sin)
    if csrc_extension(x_BSND) is None or x_BSND.numel() == 0 or cos.device != x_BSND.device:
        return rope_reference(x_BSND, cos, sin)
    cos_PD, sin_PD = kernel_tables(x_BSND, cos, sin)
    return _Rope.apply(x_BSND, cos_PD, sin_PD)
