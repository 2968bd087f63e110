"""Routed experts as two 3-D parameters, run by one grouped GEMM per projection.

Legend: R rows grouped by expert, H hidden, F expert FFN width, e local experts.

``w13 [e, H, 2F]`` holds each expert's gate and up projections side by side (gate first) and
``w2 [e, F, H]`` the down projection. One parameter per projection (never a ModuleList of
Linear): one GEMM launch for all experts, and FSDP never waits on an expert that got no tokens.
These names are the checkpoint format. With ``mlp_bias``, ``b13 [e, 2F]`` (gate first) and
``b2 [e, H]`` are the projections' biases.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_moe.config import ExpertsBackend, Fp8Config, KernelConfig
from lightning_moe.ops.deferred import Deferred, resolved
from lightning_moe.ops.expert_bias import placed_columns
from lightning_moe.ops.expert_mlp import expert_swiglu_mlp
from lightning_moe.ops.fp8.expert_mlp import (
    Fp8Options,
    dequantized_rows,
    fp8_expert_swiglu_mlp,
    fp8_local_experts,
    fp8_options,
)
from lightning_moe.ops.fp8.quantize import Fp8Tensor
from lightning_moe.ops.local_experts import local_experts
from lightning_moe.ops.permute import Permutation
from lightning_moe.ops.swiglu import PLAIN_SWIGLU, SwiGLUOptions
from lightning_moe.ops.grouped_gemm import GemmBackend, offsets_from_counts, resolve_gemm_backend

__all__ = ["GroupedExperts"]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class GroupedExperts(nn.Module):
    """SwiGLU experts: ``y = (silu(x @ W_gate) * (x @ W_up) * w) @ W_down`` per expert.

    ``mlp_bias``: the projections have biases, ``y = w * (act(x @ W_13 + b_13) @ W_down + b_down)``;
    ``swiglu``: the activation's constants (:class:`~lightning_moe.ops.swiglu.SwiGLUOptions`:
    gate scale, clamp, up offset). Both are computed by every GEMM backend (the biases are added
    outside the GEMMs); the FP8 experts compute neither and are refused with them.

    ``kernels`` (:class:`~lightning_moe.config.KernelConfig`, default: its defaults) is read here,
    once: its values are kept as plain attributes (``gemm_kernel``, ``gemm_tile``, ``wgrad_kernel``,
    ``wgrad_streams``) and passed to the ops on every call.

    ``fp8`` (:class:`~lightning_moe.config.Fp8Config`, default ``None``: GEMMs in the activation
    dtype) runs the expert GEMMs in FP8 (``ops/fp8/expert_mlp.py``), resolved once per device
    (:meth:`fp8_options`); the parameters stay in their own dtype.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        backend: ExpertsBackend = "auto",
        init_std: float = 0.02,
        kernels: KernelConfig | None = None,
        fp8: Fp8Config | None = None,
        mlp_bias: bool = False,
        swiglu: SwiGLUOptions = PLAIN_SWIGLU,
    ) -> None:
        super().__init__()
        if fp8 is not None and not isinstance(fp8, Fp8Config):
            raise TypeError(f"GroupedExperts: fp8={fp8!r} is not an Fp8Config; pass Fp8Config(...) or None.")
        if fp8 is not None and fp8.enabled != "off" and (mlp_bias or not swiglu.is_plain):
            raise ValueError(
                f"GroupedExperts: the FP8 experts compute neither expert biases nor a scaled or clamped SwiGLU "
                f"(mlp_bias={mlp_bias}, swiglu={swiglu}); set fp8=None."
            )
        self.swiglu = swiglu
        self.fp8 = fp8
        self._fp8_resolved: dict[str, Fp8Options | None] = {}
        kernels = KernelConfig() if kernels is None else kernels
        if not isinstance(kernels, KernelConfig):
            raise TypeError(
                f"GroupedExperts: kernels={kernels!r} is not a KernelConfig; pass KernelConfig(...) or None."
            )
        self.gemm_kernel: str = kernels.gemm
        self.gemm_tile: str = kernels.gemm_cutlass_tile
        self.wgrad_kernel: str = kernels.wgrad
        self.wgrad_streams: tuple[int, int] = (kernels.wgrad_streams_w13, kernels.wgrad_streams_w2)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.requested_backend = backend
        self.init_std = init_std
        # the weights were seeded per expert id or loaded from a checkpoint: seeding leaves them
        self.seeded_or_loaded = False
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size)) if mlp_bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size)) if mlp_bias else None
        # Under expert tensor parallelism this rank holds columns down_bias_offset: of the down bias
        # (parallel.parallelize._shard_experts) and adds them to those output columns only.
        self.down_bias_offset = 0
        self._resolved: dict[tuple[str, torch.dtype], GemmBackend] = {}
        # Fused local path: keep the gathered rows and the activation for backward (False: fast),
        # rebuild them there (True: lean; activation recompute sets it for its call), or None:
        # rebuild each one whose rebuild is cheap for this shape (ops.local_experts.rebuild_is_cheap).
        self.lean_backward: bool | None = None
        # Add weight gradients into an existing .grad inside the wgrad GEMMs (ops/wgrad/).
        self.fuse_wgrad_accumulation = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w13, std=self.init_std)
        nn.init.normal_(self.w2, std=self.init_std)
        for bias in (self.b13, self.b2):
            if bias is not None:
                nn.init.zeros_(bias)

    def gemm_backend(self, device: torch.device, dtype: torch.dtype) -> GemmBackend:
        """Resolved once per (device type, dtype); ``auto`` warns once when it must fall back."""
        key = (device.type, dtype)
        if key not in self._resolved:
            dims = (self.hidden_size, 2 * self.ffn_hidden_size, self.ffn_hidden_size)
            backend, reason = resolve_gemm_backend(self.requested_backend, device, dtype, dims)
            if reason is not None:
                warnings.warn(f"GroupedExperts: using the per-expert loop: {reason}.", stacklevel=2)
            self._resolved[key] = backend
        return self._resolved[key]

    def fp8_options(self, device: torch.device) -> Fp8Options | None:
        """The FP8 settings on ``device`` (``None``: bf16 experts), resolved once per device type.

        Raises a ``ValueError`` naming the fix when ``Fp8Config(enabled="on")`` cannot run here
        (e.g. on CPU without ``backend="emulate"``); see ``ops.fp8.expert_mlp.fp8_options``."""
        if self.fp8 is None:
            return None
        if device.type not in self._fp8_resolved:
            self._fp8_resolved[device.type] = fp8_options(self.fp8, device, self.hidden_size, self.ffn_hidden_size)
        return self._fp8_resolved[device.type]

    def fp8_rows(self, device: torch.device) -> tuple[str, str, bool] | None:
        """``(recipe, fmt, pow2_scales)`` of the FP8 rows the experts take from the token exchange on
        ``device`` (a dispatcher's ``fp8_rows``), or ``None`` when they take none: FP8 off here,
        ``Fp8Config(dispatch=False)``, or the tensorwise recipe (one scale over all rows, which the
        ranks of an exchange cannot share)."""
        opts = self.fp8_options(device)
        if opts is None or self.fp8 is None or not self.fp8.dispatch or opts.recipe == "tensorwise":
            return None
        return (opts.recipe, "e4m3", opts.pow2_scales)

    def _fp8_weights(self, device_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """The master weights (quantized from as they are) and the activation dtype."""
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.w13.dtype
        return _local(self.w13), _local(self.w2), dtype

    def _compute_weights(self, device_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = self.w13.dtype
        # Under expert parallelism the parameters are DTensors over the expert mesh; the math
        # runs on this rank's local experts (gradients flow back into the DTensor shard).
        return _local(self.w13).to(dtype), _local(self.w2).to(dtype), dtype

    def _compute_biases(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(b13 [e, 2f], b2 [e, H])`` of this rank in ``dtype`` (``None`` without biases); ``b2``
        is zero outside this rank's columns under expert tensor parallelism."""
        if self.b13 is None or self.b2 is None:
            return None, None
        b2 = placed_columns(_local(self.b2).to(dtype), self.down_bias_offset, self.hidden_size)
        return _local(self.b13).to(dtype), b2

    def forward(
        self,
        x_RH: torch.Tensor,
        tokens_per_expert_e: torch.Tensor,
        weights_R: torch.Tensor | None = None,
        x_fp8: Fp8Tensor | None = None,
    ) -> torch.Tensor:
        """Rows already grouped by expert -> expert outputs, same row order.

        ``x_fp8``: the rows in FP8, quantized before the token exchange; ``x_RH`` is then the
        dispatcher's differentiable stand-in for them (it receives the real input gradient). With
        the FP8 experts off here, the rows are dequantized (and the gradient still reaches ``x_RH``)."""
        opts = self.fp8_options(x_RH.device)
        if opts is not None:
            w13, w2, dtype = self._fp8_weights(x_RH.device.type)
            offs_e = offsets_from_counts(tokens_per_expert_e)
            with torch.autocast(device_type=x_RH.device.type, enabled=False):
                return fp8_expert_swiglu_mlp(
                    x_RH, w13, w2, offs_e, weights_R, opts, dtype, x_fp8, self.fuse_wgrad_accumulation
                )
        if x_fp8 is not None:
            x_RH = dequantized_rows(x_RH, x_fp8)
        device_type = x_RH.device.type
        w13, w2, dtype = self._compute_weights(device_type)
        offs_e = offsets_from_counts(tokens_per_expert_e)
        backend = self.gemm_backend(x_RH.device, dtype)
        b13, b2 = self._compute_biases(dtype)
        with torch.autocast(device_type=device_type, enabled=False):
            return expert_swiglu_mlp(
                x_RH.to(dtype), w13, w2, offs_e, weights_R, backend, self.gemm_kernel, self.gemm_tile,
                self.wgrad_kernel, b13, b2, self.swiglu,
            )  # fmt: skip

    def forward_local(
        self, x_TH: torch.Tensor, perm: Permutation, weights_R: Deferred, x_RH: Deferred | None = None
    ) -> torch.Tensor:
        """Tokens in token order -> their summed expert outputs (permute and combine fused in).

        ``weights_R`` may be a function: it is called once the first expert GEMM is launched.
        ``x_RH``: ``x_TH``'s rows in ``perm``'s order when the caller already moved them (or a
        ``TakeOnce`` of them, so that they are freed after the first GEMM when not kept)."""
        opts = self.fp8_options(x_TH.device)
        if opts is not None:
            return self._fp8_local(x_TH, perm, weights_R, x_RH, opts)
        device_type = x_TH.device.type
        w13, w2, dtype = self._compute_weights(device_type)
        offs_e = perm.offsets_E if perm.offsets_E is not None else offsets_from_counts(perm.tokens_per_expert_E)
        backend = self.gemm_backend(x_TH.device, dtype)
        args = (x_TH.to(dtype), w13, w2, weights_R, perm, offs_e, backend, self.lean_backward, self.fuse_wgrad_accumulation, x_RH)
        kernels = (self.gemm_kernel, self.gemm_tile, self.wgrad_kernel, self.wgrad_streams)
        math = (*self._compute_biases(dtype), self.swiglu)
        if not torch.is_autocast_enabled(device_type):  # no context to enter on the path to the first GEMM
            return local_experts(*args, *kernels, *math)
        with torch.autocast(device_type=device_type, enabled=False):
            return local_experts(*args, *kernels, *math)

    def _fp8_local(
        self, x_TH: torch.Tensor, perm: Permutation, weights_R: Deferred, x_RH: Deferred | None, opts: Fp8Options
    ) -> torch.Tensor:
        w13, w2, dtype = self._fp8_weights(x_TH.device.type)
        offs_e = perm.offsets_E if perm.offsets_E is not None else offsets_from_counts(perm.tokens_per_expert_E)
        x_RH = None if x_RH is None else resolved(x_RH)
        with torch.autocast(device_type=x_TH.device.type, enabled=False):
            return fp8_local_experts(
                x_TH, w13, w2, weights_R, perm, offs_e, opts, dtype, x_RH, self.fuse_wgrad_accumulation
            )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, backend={self.requested_backend!r}, "
            f"gemm={self.gemm_kernel!r}, wgrad={self.wgrad_kernel!r}"
            + ("" if self.fp8 is None else f", fp8={self.fp8.recipe!r}")
            + ("" if self.b13 is None else ", mlp_bias=True")
            + ("" if self.swiglu.is_plain else f", swiglu={tuple(self.swiglu)}")
        )
