"""Weighted SwiGLU: ``a_RF = silu(gate_RF) * up_RF * w_R`` with ``h_R2F = [gate | up]``.

Legend: R rows (dispatched tokens), F expert FFN width. Carrying the routing weight ``w_R``
into the activation is the memory-efficient permutation: the combine becomes a plain sum and
the weight's gradient ``grad_w_R = sum_f grad_a * silu(gate) * up`` needs only ``h``, which the
expert MLP saves anyway. Math runs in fp32; outputs take ``h``'s dtype.

:class:`SwiGLUOptions` generalises the activation (gpt-oss):

    g = min(gate, limit);  u = clamp(up, -limit, limit)     # no clamp when limit is None
    a = g * sigmoid(alpha * g) * (u + up_offset) * w

The default options are the plain SwiGLU, which runs the csrc kernels on CUDA; any other runs the
torch code here on every device (clamped values get no gradient, as ``torch.clamp``'s).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lightning_moe.ops.backend import csrc_extension

__all__ = [
    "PLAIN_SWIGLU",
    "SwiGLUOptions",
    "weighted_swiglu",
    "weighted_swiglu_backward",
    "weighted_swiglu_forward",
    "weighted_swiglu_reference",
]


class SwiGLUOptions(NamedTuple):
    """The activation's constants: ``sigmoid(alpha * g)``, the clamp ``limit`` (``None``: none) and
    the ``up_offset`` added to the up projection (gpt-oss: 1.702, 7.0, 1.0)."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    @property
    def is_plain(self) -> bool:
        """``silu(gate) * up``: what the csrc kernels compute."""
        return self.alpha == 1.0 and self.limit is None and self.up_offset == 0.0


PLAIN_SWIGLU = SwiGLUOptions()


def _clamped(h_R2F: torch.Tensor, opts: SwiGLUOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, u + up_offset)`` in fp32: the clamped gate and the clamped, offset up projection."""
    gate_RF, up_RF = h_R2F.float().chunk(2, dim=-1)
    if opts.limit is not None:
        gate_RF = gate_RF.clamp(max=opts.limit)
        up_RF = up_RF.clamp(min=-opts.limit, max=opts.limit)
    return gate_RF, up_RF + opts.up_offset


def weighted_swiglu_reference(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None = None, opts: SwiGLUOptions = PLAIN_SWIGLU
) -> torch.Tensor:
    """The spec: ``silu(gate) * up * w`` (or ``opts``' variant) in fp32, cast back to ``h``'s dtype."""
    if opts.is_plain:
        gate_RF, up_RF = h_R2F.float().chunk(2, dim=-1)
        a_RF = F.silu(gate_RF) * up_RF
    else:
        gate_RF, up_RF = _clamped(h_R2F, opts)
        a_RF = gate_RF * torch.sigmoid(opts.alpha * gate_RF) * up_RF
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


def _backward_general(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None, grad_a_RF: torch.Tensor, need_grad_w: bool, opts: SwiGLUOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of :class:`SwiGLUOptions`' activation, in fp32."""
    gate_RF, up_RF = _clamped(h_R2F, opts)
    g_RF = grad_a_RF.float()
    sig_RF = torch.sigmoid(opts.alpha * gate_RF)
    act_RF = gate_RF * sig_RF
    grad_w_R = (g_RF * act_RF * up_RF).sum(-1) if (w_R is not None and need_grad_w) else None
    if w_R is not None:
        g_RF = g_RF * w_R.float().unsqueeze(-1)
    dact_RF = sig_RF * (1 + opts.alpha * gate_RF * (1 - sig_RF))
    grad_gate_RF, grad_up_RF = g_RF * up_RF * dact_RF, g_RF * act_RF
    if opts.limit is not None:  # no gradient where the clamp is active (torch.clamp's rule)
        raw_gate_RF, raw_up_RF = h_R2F.float().chunk(2, dim=-1)
        grad_gate_RF = grad_gate_RF * (raw_gate_RF <= opts.limit)
        grad_up_RF = grad_up_RF * (raw_up_RF.abs() <= opts.limit)
    return torch.cat([grad_gate_RF, grad_up_RF], dim=-1).to(h_R2F.dtype), grad_w_R


def weighted_swiglu_forward(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None, opts: SwiGLUOptions = PLAIN_SWIGLU
) -> torch.Tensor:
    ext = csrc_extension(h_R2F) if opts.is_plain else None
    if ext is None or h_R2F.shape[0] == 0:
        return weighted_swiglu_reference(h_R2F, w_R, opts)
    return ext.weighted_swiglu_fwd(h_R2F.contiguous(), None if w_R is None else w_R.float().contiguous())


def weighted_swiglu_backward(
    h_R2F: torch.Tensor,
    w_R: torch.Tensor | None,
    grad_a_RF: torch.Tensor,
    need_grad_w: bool = True,
    opts: SwiGLUOptions = PLAIN_SWIGLU,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_h_R2F, grad_w_R)``; ``grad_w_R`` is ``None`` without weights or when not needed."""
    if not opts.is_plain:
        return _backward_general(h_R2F, w_R, grad_a_RF, need_grad_w, opts)
    ext = csrc_extension(h_R2F)
    if ext is None or h_R2F.shape[0] == 0:
        return _backward_reference(h_R2F, w_R, grad_a_RF, need_grad_w)
    w = None if w_R is None else w_R.float().contiguous()
    grad_h, grad_w = ext.weighted_swiglu_bwd(h_R2F.contiguous(), w, grad_a_RF.contiguous(), need_grad_w and w is not None)
    return grad_h, grad_w


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, h_R2F: torch.Tensor, w_R: torch.Tensor | None, opts: SwiGLUOptions
    ) -> torch.Tensor:
        ctx.save_for_backward(h_R2F, w_R)
        ctx.opts = opts
        return weighted_swiglu_forward(h_R2F, w_R, opts)

    @staticmethod
    def backward(ctx, grad_a_RF: torch.Tensor):  # type: ignore[override]
        h_R2F, w_R = ctx.saved_tensors
        need_w = w_R is not None and ctx.needs_input_grad[1]
        grad_h, grad_w = weighted_swiglu_backward(h_R2F, w_R, grad_a_RF, need_w, ctx.opts)
        return grad_h, (grad_w.to(w_R.dtype) if grad_w is not None else None), None


def weighted_swiglu(
    h_R2F: torch.Tensor, w_R: torch.Tensor | None = None, opts: SwiGLUOptions = PLAIN_SWIGLU
) -> torch.Tensor:
    """Differentiable weighted SwiGLU (saves only ``h`` and ``w``)."""
    return _WeightedSwiGLU.apply(h_R2F, w_R, opts)
