"""Router logits in fp32: ``logits_TE = x_TH @ w_EH^T`` with fp32 output and gradients.

Legend: T tokens, H hidden, E experts.

When ``x`` and ``w`` are both bf16 (or both fp16) on CUDA, the product of two 16-bit values is
exact in fp32, so a 16-bit GEMM that accumulates and writes fp32 (``torch.mm(..., out_dtype=)``)
gives the fp32 router's logits without upcasting ``x`` (no T*H fp32 copy, nothing extra saved:
``x`` is held by the caller anyway). On CUDA that GEMM is the csrc kernel ``router_logits``
(``csrc/router_gemm.cu``) when the extension is available and ``H % 8 == 0``: the router's GEMM
is the first call of the layer's step, and a cuBLAS call made right after a host
synchronisation costs ~100 µs more host time than a plain kernel launch while the device waits
(H200, ``benchmarks/probes/host_path.py --cold-sequence``); otherwise ``torch.mm(..., out_dtype=)``. In backward each gradient is produced in the dtype of the
tensor it belongs to: ``grad_x`` and ``grad_w`` are 16-bit, so their GEMMs take the fp32
``grad_logits`` rounded once to 16 bits and accumulate in fp32 — one extra rounding of the same
size as the final one, for tensor-core speed instead of an fp32 GEMM. Elsewhere (CPU, fp32 weights,
mixed dtypes) both operands are upcast and the GEMM runs in the requested dtype — the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_moe.ops.backend import csrc_extension

__all__ = ["router_logits", "router_logits_reference", "router_logits_backward"]


def router_logits_reference(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.linear(x_TH.to(dtype), w_EH.to(dtype))


def _mixed_ok(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        dtype == torch.float32
        and x_TH.is_cuda
        and x_TH.dtype == w_EH.dtype
        and x_TH.dtype in (torch.bfloat16, torch.float16)
    )


def kernel_fits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> bool:
    """Whether the csrc ``router_logits`` kernel takes these (contiguous, 16-byte aligned, H % 8 == 0)."""
    return (
        x_TH.shape[-1] % 8 == 0
        and x_TH.is_contiguous()
        and w_EH.is_contiguous()
        and x_TH.data_ptr() % 16 == 0
        and w_EH.data_ptr() % 16 == 0
    )


def _mixed_logits(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    ext = csrc_extension(x_TH)
    if ext is not None and kernel_fits(x_TH, w_EH):
        return ext.router_logits(x_TH, w_EH)
    return torch.mm(x_TH, w_EH.t(), out_dtype=torch.float32)


def router_logits_backward(ctx, grad_TE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # noqa: ANN001
    """``(grad_x, grad_w)`` of ``x @ w^T`` from a node that saved ``(x, w, ...)``: 16-bit GEMMs on the
    fp32 gradient rounded once (module docstring)."""
    x_TH, w_EH = ctx.saved_tensors[:2]
    grad_TE = grad_TE.to(x_TH.dtype)
    grad_x = grad_TE @ w_EH if ctx.needs_input_grad[0] else None
    grad_w = grad_TE.t() @ x_TH if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_TH, w_EH)
        return _mixed_logits(x_TH, w_EH)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):  # type: ignore[override]
        return router_logits_backward(ctx, grad_TE)


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Differentiable ``x @ w^T`` in ``dtype`` (see the module docstring for the fast case)."""
    if _mixed_ok(x_TH, w_EH, dtype):
        try:
            return _RouterLogits.apply(x_TH.contiguous(), w_EH)
        except (RuntimeError, TypeError):  # torch without mm(out_dtype=) for this device
            pass
    return router_logits_reference(x_TH, w_EH, dtype)
