"""One fused kernel for the RMSNorms of Hugging Face MoE models, swapped in place.

transformers writes its RMSNorm (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 alike) as five
elementwise passes in eager PyTorch — upcast to fp32, square, mean, scale, downcast, times the
weight — and autograd keeps fp32 copies of the input for backward. In a 4-layer
Qwen3-30B-A3B-shaped model on an H200 those passes (the hidden-state norms and the per-head q/k
norms) are the largest item its step spends beyond our own transformer's (``benchmarks/e2e.py
--profile``). :class:`FusedRMSNorm` computes the same function with ``torch.nn.functional.rms_norm``
(one kernel forward, one backward, fp32 inside) and keeps the HF module's interface: the *same*
``weight`` parameter (state-dict keys, optimizer state and checkpoints are unchanged) and
``variance_epsilon``.

Numerics: in fp32 the two agree to rounding. In bf16/fp16 HF rounds the normalised value to the
input dtype before multiplying by the weight; the fused kernel rounds once, after — outputs differ
by at most about one unit in the last place. When the weight's dtype differs from the input's (an
fp32 weight under autocast, say) HF's own formula runs, so its type promotion is kept.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HF_RMS_NORMS", "FusedRMSNorm", "swap_rms_norms"]

# HF classes whose forward is ``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype)``; matched
# against the class and its bases. Norms of other shapes (Gemma's ``1 + weight``, say) stay.
HF_RMS_NORMS: tuple[str, ...] = ("Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "DeepseekV3RMSNorm")


def hf_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' formula, for the mixed-dtype case and as the tests' reference."""
    x32 = x.float()
    normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalised.to(x.dtype)


class FusedRMSNorm(nn.Module):
    """An HF RMSNorm computed by one fused kernel; holds the original module's ``weight``."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            return hf_rms_norm_reference(hidden_states, self.weight, self.variance_epsilon)
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    def reset_parameters(self) -> None:
        """The weight as transformers initialises these norms (ones): a model built on ``meta`` and
        materialised by the strategy gets it."""
        with torch.no_grad():
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


def _is_hf_rms_norm(module: nn.Module) -> bool:
    if not any(cls.__name__ in HF_RMS_NORMS for cls in type(module).__mro__):
        return False
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(eps, float)


def swap_rms_norms(model: nn.Module) -> list[str]:
    """Replace every HF RMSNorm of :data:`HF_RMS_NORMS` in ``model`` by a :class:`FusedRMSNorm`
    holding the same weight; returns the qualified names of the swapped modules.

    Call before building the optimizer or wrapping the model (the parameters are the same objects,
    so an optimizer built earlier stays valid as well). Saving (``state_dict``, ``save_pretrained``,
    DCP) sees the same keys and values as before.
    """
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if _is_hf_rms_norm(child):
                setattr(parent, child_name, FusedRMSNorm(child.weight, child.variance_epsilon))
                swapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return swapped
