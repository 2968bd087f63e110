"""The expert SwiGLU MLP over grouped rows, with a hand-written backward.

Legend: R rows grouped by expert, H hidden, F expert FFN width, E local experts.

    h_R2F = gmm(x_RH, w13_EH2F) + b13      # [gate | up]; the bias optional
    a_RF  = silu(gate) * up * w_R           # weighted SwiGLU (w_R optional; ops/swiglu.py's variants)
    y_RH  = gmm(a_RF, w2_EFH) + w_R * b2    # the down bias optional, weighted like the output

Saved for backward: ``x_RH``, ``h_R2F`` and the weights — not ``a_RF``, which the backward
recomputes from ``h`` (one elementwise pass instead of R*F activations held for the whole step).
Autograd through ``F.grouped_mm`` would keep ``a_RF`` too and run a second copy of the SwiGLU.
"""

from __future__ import annotations

import torch

from lightning_moe.ops.expert_bias import bias_grad, bias_rows, down_bias_grads, expert_of_rows
from lightning_moe.ops.grouped_gemm_cutlass import DEFAULT_TILE
from lightning_moe.ops.grouped_gemm import GemmBackend, gmm, gmm_wgrad
from lightning_moe.ops.swiglu import (
    PLAIN_SWIGLU,
    SwiGLUOptions,
    weighted_swiglu_backward,
    weighted_swiglu_forward,
    weighted_swiglu_reference,
)

__all__ = ["expert_swiglu_mlp", "expert_swiglu_mlp_reference"]


def expert_swiglu_mlp_reference(
    x_RH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_R: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    opts: SwiGLUOptions = PLAIN_SWIGLU,
) -> torch.Tensor:
    """Plain autograd, one expert at a time (the spec): ``y = w * (act(x @ w13 + b13) @ w2 + b2)``."""
    out = []
    start = 0
    for e, count in enumerate(tokens_per_expert_E.tolist()):
        rows = slice(start, start + count)
        h = x_RH[rows] @ w13[e]
        if b13 is not None:
            h = h + b13[e]
        w = None if w_R is None else w_R[rows]
        y = weighted_swiglu_reference(h, w, opts) @ w2[e]
        if b2 is not None:
            y = y + (b2[e] if w is None else b2[e] * w.unsqueeze(-1).to(y.dtype))
        out.append(y)
        start += count
    if start < x_RH.shape[0]:
        out.append(x_RH.new_zeros(x_RH.shape[0] - start, w2.shape[-1]))
    return torch.cat(out) if out else x_RH.new_zeros(0, w2.shape[-1])


class _ExpertSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_RH: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        offs_E: torch.Tensor,
        w_R: torch.Tensor | None,
        backend: GemmBackend,
        kernels: tuple[str, str],
        b13: torch.Tensor | None,
        b2: torch.Tensor | None,
        opts: SwiGLUOptions,
    ) -> torch.Tensor:
        gemm = (backend, *kernels)
        expert_R = None if b13 is None and b2 is None else expert_of_rows(offs_E, x_RH.shape[0])
        h_R2F = gmm(x_RH, w13, offs_E, *gemm)
        if b13 is not None:
            h_R2F.add_(bias_rows(b13, expert_R))
        a_RF = weighted_swiglu_forward(h_R2F, w_R, opts)
        y_RH = gmm(a_RF, w2, offs_E, *gemm)
        if b2 is not None:  # y = w * (a @ w2 + b2), with w already inside a
            b2_RH = bias_rows(b2, expert_R)
            y_RH.add_(b2_RH if w_R is None else b2_RH * w_R.unsqueeze(-1).to(b2_RH.dtype))
        ctx.gemm, ctx.wgrad, ctx.opts = gemm, (backend,), opts
        ctx.save_for_backward(x_RH, h_R2F, w13, w2, offs_E, w_R, b13, b2, expert_R)
        return y_RH

    @staticmethod
    def backward(ctx, grad_y_RH: torch.Tensor):  # type: ignore[override]
        x_RH, h_R2F, w13, w2, offs_E, w_R, b13, b2, expert_R = ctx.saved_tensors
        gemm, wgrad, opts = ctx.gemm, ctx.wgrad, ctx.opts
        grad_y_RH = grad_y_RH.contiguous()
        need_b2, need_w = ctx.needs_input_grad[8], w_R is not None and ctx.needs_input_grad[4]
        grad_b2, grad_w_from_b2 = down_bias_grads(grad_y_RH, w_R, b2, expert_R, need_b2, need_w)
        grad_a_RF = gmm(grad_y_RH, w2.transpose(1, 2), offs_E, *gemm)
        grad_w2 = None
        if ctx.needs_input_grad[2]:
            a_RF = weighted_swiglu_forward(h_R2F, w_R, opts)
            grad_w2 = gmm_wgrad(a_RF, grad_y_RH, offs_E, *wgrad)
            del a_RF
        grad_h_R2F, grad_w_R = weighted_swiglu_backward(h_R2F, w_R, grad_a_RF, need_w, opts)
        del grad_a_RF
        grad_x_RH = gmm(grad_h_R2F, w13.transpose(1, 2), offs_E, *gemm) if ctx.needs_input_grad[0] else None
        grad_w13 = gmm_wgrad(x_RH, grad_h_R2F, offs_E, *wgrad) if ctx.needs_input_grad[1] else None
        grad_b13 = None
        if b13 is not None and ctx.needs_input_grad[7]:
            grad_b13 = bias_grad(grad_h_R2F, expert_R, b13.shape[0], b13.dtype)
        if grad_w_R is not None:
            grad_w_R = (grad_w_R if grad_w_from_b2 is None else grad_w_R + grad_w_from_b2).to(w_R.dtype)
        return grad_x_RH, grad_w13, grad_w2, None, grad_w_R, None, None, grad_b13, grad_b2, None


def expert_swiglu_mlp(
    x_RH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    offs_E: torch.Tensor,
    w_R: torch.Tensor | None = None,
    backend: GemmBackend = "torch",
    gemm_kernel: str = "auto",
    gemm_tile: str = DEFAULT_TILE,
    wgrad_kernel: str = "auto",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    opts: SwiGLUOptions = PLAIN_SWIGLU,
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by ``offs_E`` (inclusive int32 cumsum); differentiable.

    ``gemm_kernel``, ``gemm_tile``: the resolved ``KernelConfig`` values (``ops/grouped_gemm.gmm``
    says what they choose). ``wgrad_kernel`` is taken with them and changes nothing here: this path
    writes fresh weight gradients, which ``F.grouped_mm`` always computes. ``b13 [E, 2F]`` and
    ``b2 [E, H]``: optional biases of the two projections (``y = w * (act(x @ w13 + b13) @ w2 + b2)``);
    ``opts``: the activation's constants (:class:`~lightning_moe.ops.swiglu.SwiGLUOptions`)."""
    return _ExpertSwiGLUMLP.apply(
        x_RH, w13, w2, offs_E, w_R, backend, (gemm_kernel, gemm_tile), b13, b2, opts
    )
