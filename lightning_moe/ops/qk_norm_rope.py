"""Per-head RMSNorm of queries or keys followed by the rotary embedding, fused (Qwen3-style q/k norm).

Legend: B batch, S sequence, N heads, D head dim.

``qk_norm_rope(x, norm, cos, sin) == rope(norm(x), cos, sin)`` for ``x [B, S, N, D]`` and an
``nn.RMSNorm(D)`` with a weight. On CUDA with the csrc extension and D in {64, 128, 192, 256} one
kernel normalizes and rotates each head row in fp32 registers (the unfused path rounds the norm's
output to ``x``'s dtype, writes it and reads it back), saving one fp32 scale per row for the
backward, which is one kernel too (the weight's gradient from per-block partial sums, summed in a
fixed order). Elsewhere the two ops run one after the other.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_moe.ops.backend import csrc_extension
from lightning_moe.ops.rope import check_rope_inputs, kernel_tables, rope

__all__ = ["FUSED_HEAD_DIMS", "qk_norm_rope", "qk_norm_rope_reference"]

FUSED_HEAD_DIMS = (64, 128, 192, 256)


def qk_norm_rope_reference(x_BSND: torch.Tensor, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The unfused pair: the norm module, then :func:`rope`."""
    return rope(norm(x_BSND), cos, sin)


class _QkNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSND, weight_D, cos_PD, sin_PD, eps):  # noqa: ANN001, ANN205
        ext = csrc_extension(x_BSND)
        B, S, N, D = x_BSND.shape
        x_TND = x_BSND.contiguous().view(B * S, N, D)
        y, rstd = ext.qk_norm_rope_fwd(x_TND, weight_D.contiguous(), cos_PD, sin_PD, float(eps))
        ctx.save_for_backward(x_TND, weight_D, cos_PD, sin_PD, rstd)
        return y.view(B, S, N, D)

    @staticmethod
    def backward(ctx, grad_BSND):  # noqa: ANN001, ANN205
        x_TND, weight_D, cos_PD, sin_PD, rstd = ctx.saved_tensors
        ext = csrc_extension(x_TND)
        g = grad_BSND.contiguous().view_as(x_TND)
        dx, dw_partial = ext.qk_norm_rope_bwd(x_TND, weight_D.contiguous(), cos_PD, sin_PD, rstd, g)
        dw = dw_partial.sum(0).to(weight_D.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(grad_BSND.shape), dw, None, None, None


def _fusable(x_BSND: torch.Tensor, norm: nn.Module, cos: torch.Tensor) -> bool:
    weight = getattr(norm, "weight", None)
    return (
        type(norm) is nn.RMSNorm
        and isinstance(weight, torch.Tensor)
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor (sharded norms take the unfused path)
        and tuple(norm.normalized_shape) == (x_BSND.shape[-1],)
        and x_BSND.shape[-1] in FUSED_HEAD_DIMS
        and x_BSND.numel() > 0
        and weight.dtype == x_BSND.dtype
        and weight.device == x_BSND.device == cos.device
        and csrc_extension(x_BSND) is not None
    )


def qk_norm_rope(x_BSND: torch.Tensor, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope(norm(x), cos, sin)``; tables ``[S, D/2]`` or ``[B, S, D/2]`` as for :func:`rope`."""
    check_rope_inputs(x_BSND, cos, sin)
    if not _fusable(x_BSND, norm, cos):
        return qk_norm_rope_reference(x_BSND, norm, cos, sin)
    eps = norm.eps if norm.eps is not None else torch.finfo(x_BSND.dtype).eps
    cos_PD, sin_PD = kernel_tables(x_BSND, cos, sin)
    return _QkNormRope.apply(x_BSND, norm.weight, cos_PD, sin_PD, eps)
