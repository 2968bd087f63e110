"""Weighted SwiGLU: ``a_RF = silu(gate_RF) * up_RF * w_R`` with ``h_R2F = [gate | up]``.

Legend: R rows (dispatched tokens), F expert FFN width. Carrying the routing weight ``w_R``
into the activation is the memory-efficient permutation: the combine becomes a plain sum and
the weight's gradient ``grad_w_R = sum_f grad_a * silu(gate) * up`` needs only ``h``, which the
expert MLP saves anyway. Math runs in fp32; outputs take ``h``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_moe.ops.backend import csrc_extension

__all__ = ["weighted_swiglu", "weighted_swiglu_reference", "weighted_swiglu_backward"]


def weighted_swiglu_reference(h_R2F: torch.Tensor, w_R: torch.Tensor | None = None) -> torch.Tensor:
    """The spec: ``silu(gate) * up * w`` in fp32, cast back to ``h``'s dtype."""
    gate_RF, up_RF = h_R2F.float().chunk(2, dim=-1)
    a_RF = F.silu(gate_RF) * up_RF
    if w_R is not None:
        a_RF = a_RF * w_R.float().unsqueeze(-1)
    return a_RF.to(h_R2F.dtype)


def _backward_reference(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None, grad_a_RF: torch.Tensor, need_grad_w: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    gate_RF, up_RF = h_R2F.float().chunk(2, dim=-1)
    g_RF = grad_a_RF.float()
    sig_RF = torch.sigmoid(gate_RF)
    silu_RF = gate_RF * sig_RF
    grad_w_R = (g_RF * silu_RF * up_RF).sum(-1) if (w_R is not None and need_grad_w) else None
    if w_R is not None:
        g_RF = g_RF * w_R.float().unsqueeze(-1)
    dsilu_RF = sig_RF * (1 + gate_RF * (1 - sig_RF))
    grad_h_R2F = torch.cat([g_RF * up_RF * dsilu_RF, g_RF * silu_RF], dim=-1).to(h_R2F.dtype)
    return grad_h_R2F, grad_w_R


def weighted_swiglu_forward(h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> torch.Tensor:
    ext = csrc_extension(h_R2F)
    if ext is None or h_R2F.shape[0] == 0:
        return weighted_swiglu_reference(h_R2F, w_R)
    return ext.weighted_swiglu_fwd(h_R2F.contiguous(), None if w_R is None else w_R.float().contiguous())


def weighted_swiglu_backward(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None, grad_a_RF: torch.Tensor, need_grad_w: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_h_R2F, grad_w_R)``; ``grad_w_R`` is ``None`` without weights or when not needed."""
    ext = csrc_extension(h_R2F)
    if ext is None or h_R2F.shape[0] == 0:
        return _backward_reference(h_R2F, w_R, grad_a_RF, need_grad_w)
    w = None if w_R is None else w_R.float().contiguous()
    grad_h, grad_w = ext.weighted_swiglu_bwd(h_R2F.contiguous(), w, grad_a_RF.contiguous(), need_grad_w and w is not None)
    return grad_h, grad_w


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h_R2F, w_R)
        return weighted_swiglu_forward(h_R2F, w_R)

    @staticmethod
    def backward(ctx, grad_a_RF: torch.Tensor):  # type: ignore[override]
        h_R2F, w_R = ctx.saved_tensors
        need_w = w_R is not None and ctx.needs_input_grad[1]
        grad_h, grad_w = weighted_swiglu_backward(h_R2F, w_R, grad_a_RF, need_w)
        return grad_h, (grad_w.to(w_R.dtype) if grad_w is not None else None)


def weighted_swiglu(h_R2F: torch.Tensor, w_R: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable weighted SwiGLU (saves only ``h`` and ``w``)."""
    return _WeightedSwiGLU.apply(h_R2F, w_R)
