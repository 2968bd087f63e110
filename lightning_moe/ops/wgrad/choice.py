"""Which weight-gradient kernel runs: the requested one (``KernelConfig.wgrad``) resolved per shape.

Legend: R rows grouped by expert, D input width, O output width, E experts.

The requested kernel is a plain string handed down from the layer's construction; nothing here
reads the environment. ``auto`` and the fallbacks are decided from the tensors of one layer call.
"""

from __future__ import annotations

from typing import get_args

import torch

from lightning_moe.config import WgradKernel
from lightning_moe.ops.wgrad import cutlass_kernel

__all__ = [
    "WGRAD_KERNELS",
    "auto_kernel",
    "fusion_kernel",
    "fusion_pays",
    "may_fuse",
    "wide_experts",
]

WGRAD_KERNELS = get_args(WgradKernel)

# Below this many bytes of one expert's weights (w13 + w2), one GEMM launch per expert costs more
# host time than the GPU time it saves: the grouped GEMM and autograd's addition stay.
_MIN_EXPERT_WEIGHT_BYTES = 32 << 20

# From this many experts on, ``auto`` deals them over streams: hundreds of short GEMMs in one
# stream leave a gap between each pair (DeepSeek-V3's 256 experts: 3 ms a step on the H200).
_STREAMS_FROM_EXPERTS = 16


def fusion_pays(hidden_size: int, ffn_hidden_size: int, element_size: int) -> bool:
    """Whether per-expert accumulating GEMMs beat one grouped GEMM plus an addition for this shape.

    DeepSeek-V3 (88 MB per expert in bf16) and Mixtral (352 MB) do; Qwen3-30B-A3B (9.4 MB,
    128 small GEMMs per projection) does not.
    """
    return 3 * hidden_size * ffn_hidden_size * element_size >= _MIN_EXPERT_WEIGHT_BYTES


def wide_experts(w2: torch.Tensor) -> bool:
    """Whether the experts (down-projection ``[E, F, H]``) are wide enough for per-expert GEMMs to pay."""
    return fusion_pays(w2.shape[-1], w2.shape[-2], w2.element_size())


def auto_kernel(num_experts: int) -> str:
    """What ``auto`` runs on CUDA with the cuBLAS GEMMs: two streams for many experts, else one."""
    return "streams" if num_experts >= _STREAMS_FROM_EXPERTS else "loop"


def _check(kernel: str) -> None:
    if kernel not in WGRAD_KERNELS:
        raise ValueError(f"wgrad kernel={kernel!r} is not one of {WGRAD_KERNELS}; choose one of them.")


def fusion_kernel(kernel: str, offs_E: torch.Tensor, x: torch.Tensor, weights: tuple[torch.Tensor, ...] = ()) -> str:
    """The kernel one layer call runs for the requested ``kernel``: never ``auto``, and never one
    that cannot run on these tensors (CUTLASS unavailable, streams off CUDA: the loop)."""
    _check(kernel)
    if kernel == "cutlass" or (kernel == "auto" and weights and not wide_experts(weights[-1])):
        kernel = "cutlass" if cutlass_kernel.supported(x, *weights) else auto_kernel(offs_E.numel())
    elif kernel == "auto":
        kernel = auto_kernel(offs_E.numel())
    if kernel == "streams" and not x.is_cuda:
        kernel = "loop"
    return kernel


def may_fuse(kernel: str, w13: torch.Tensor, w2: torch.Tensor, x_TH: torch.Tensor) -> bool:
    """Whether this layer call should add its weight gradients into ``.grad`` in place at all."""
    if not (w13.is_leaf and w2.is_leaf and torch.is_grad_enabled() and (w13.requires_grad or w2.requires_grad)):
        return False
    if w13.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    # One grouped CUTLASS launch per weight pays for any width; per-expert cuBLAS GEMMs only for
    # wide experts.
    if kernel in ("auto", "cutlass") and cutlass_kernel.supported(x_TH, w13, w2):
        return True
    return wide_experts(w2)

