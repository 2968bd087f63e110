"""Router logits in fp32: ``logits_TE = x_TH @ w_EH^T`` with fp32 output and gradients.

Legend: T tokens, H hidden, E experts.

When ``x`` and ``w`` are both bf16 (or both fp16) on CUDA, the product of two 16-bit values is
exact in fp32, so a 16-bit GEMM that accumulates and writes fp32 (``torch.mm(..., out_dtype=)``)
gives the fp32 router's logits without upcasting ``x`` (no T*H fp32 copy, nothing extra saved:
``x`` is held by the caller anyway). In backward each gradient is produced in the dtype of the
tensor it belongs to: ``grad_x`` and ``grad_w`` are 16-bit, so their GEMMs take the fp32
``grad_logits`` rounded once to 16 bits and accumulate in fp32 — one extra rounding of the same
size as the final one, for tensor-core speed instead of an fp32 GEMM. Elsewhere (CPU, fp32 weights,
mixed dtypes) both operands are upcast and the GEMM runs in the requested dtype — the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["router_logits", "router_logits_reference"]


def router_logits_reference(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.linear(x_TH.to(dtype), w_EH.to(dtype))


def _mixed_ok(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        dtype == torch.float32
        and x_TH.is_cuda
        and x_TH.dtype == w_EH.dtype
        and x_TH.dtype in (torch.bfloat16, torch.float16)
    )


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_TH, w_EH)
        return torch.mm(x_TH, w_EH.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):  # type: ignore[override]
        x_TH, w_EH = ctx.saved_tensors
        grad_TE = grad_TE.to(x_TH.dtype)
        grad_x = grad_TE @ w_EH if ctx.needs_input_grad[0] else None
        grad_w = grad_TE.t() @ x_TH if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Differentiable ``x @ w^T`` in ``dtype`` (see the module docstring for the fast case)."""
    if _mixed_ok(x_TH, w_EH, dtype):
        try:
            return _RouterLogits.apply(x_TH.contiguous(), w_EH)
        except (RuntimeError, TypeError):  # torch without mm(out_dtype=) for this device
            pass
    return router_logits_reference(x_TH, w_EH, dtype)
