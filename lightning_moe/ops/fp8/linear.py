"""A dense linear layer with FP8 GEMMs, forward and backward: ``y = x @ W^T`` (no bias).

Legend: M rows (tokens), K input width, N output width. ``q(t, along)``: ``t`` quantized
(``ops/fp8/quantize.py``) in units constant along the contracted dim.

    forward                       backward (gradients in ``grad_format``)
    y_MN = q(x_MK) @ q(W_NK)^T    grad_x_MK = q(dy_MN) @ q(W_NK along N)
                                  grad_W_NK = q(dy_MN^T along M) @ q(x_MK along M)

Activations and gradients are quantized along the contracted dim (blockwise: 1 x 128 tiles, also
along M for the weight gradient, where M is contracted), the weight along its input dim for the
forward and along its output dim for the data gradient (blockwise: 128 x 128 tiles), re-quantized
from the master weight each step; no FP8 weight outlives the call. The input is saved for backward
in its own dtype (a dense layer's input is usually saved by its neighbours too, so an FP8 copy would
add memory, not save it). The output and both gradients are in the input's dtype.

Under tensor parallelism the weight is a DTensor: the GEMMs run on the local shard and the output
is wrapped back with the placement the layout implies (column-parallel ``Shard(0)`` weight ->
``Shard(-1)`` output; row-parallel ``Shard(1)`` -> ``Partial`` output), so
``ColwiseParallel`` / ``RowwiseParallel`` see the DTensor a plain ``nn.Linear`` would return.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_moe.ops.fp8.expert_mlp import Fp8Options
from lightning_moe.ops.fp8.gemm import fp8_mm
from lightning_moe.ops.fp8.quantize import quantize

__all__ = ["Fp8Linear", "fp8_linear"]

_WGRAD_TILE = (1, 128)  # blockwise units of both weight-gradient operands: 128 along the contracted M


def _tile(opts: Fp8Options) -> tuple[int, int] | None:
    return _WGRAD_TILE if opts.recipe == "blockwise" else None


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, opts: Fp8Options) -> torch.Tensor:  # type: ignore[override]
        out_dtype = x_MK.dtype
        qx = quantize(x_MK, opts.recipe, "e4m3", reduce_dim=-1, pow2_scales=opts.pow2_scales)
        qw = quantize(w_NK, opts.recipe, "e4m3", reduce_dim=-1, pow2_scales=opts.pow2_scales,
                      tile=(128, 128) if opts.recipe == "blockwise" else None)  # fmt: skip
        y_MN = fp8_mm(qx, qw.transpose(), out_dtype, opts.backend)
        ctx.opts = opts
        ctx.save_for_backward(x_MK, w_NK)
        return y_MN

    @staticmethod
    def backward(ctx, grad_y_MN: torch.Tensor):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        opts: Fp8Options = ctx.opts
        dy = grad_y_MN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            qdy = quantize(dy, opts.recipe, opts.grad_format, reduce_dim=-1, pow2_scales=opts.pow2_scales)
            qw = quantize(w_NK, opts.recipe, "e4m3", reduce_dim=-2, pow2_scales=opts.pow2_scales)
            grad_x = fp8_mm(qdy, qw, x_MK.dtype, opts.backend)
        if ctx.needs_input_grad[1]:
            qdy_t = quantize(dy.t(), opts.recipe, opts.grad_format, reduce_dim=-1, pow2_scales=opts.pow2_scales)
            qx = quantize(x_MK, opts.recipe, "e4m3", reduce_dim=-2, pow2_scales=opts.pow2_scales, tile=_tile(opts))
            grad_w = fp8_mm(qdy_t, qx, w_NK.dtype, opts.backend)
        return grad_x, grad_w, None


def _output_placement(weight: DTensor) -> list:
    (placement,) = weight.placements  # one TP mesh dim: what parallelize_module gives a Linear
    if isinstance(placement, Shard) and placement.dim == 0:
        return [Shard(-1)]
    if isinstance(placement, Shard) and placement.dim == 1:
        return [Partial()]
    return [Replicate()]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, opts: Fp8Options) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T`` with FP8 GEMMs (differentiable in both)."""
    if isinstance(weight, DTensor):
        out_placements = _output_placement(weight)
        if isinstance(x, DTensor):
            # A replicated input of a column-parallel layer gets a partial gradient from each rank's
            # shard: declared Partial, the DTensor backward sums it over the group.
            replicated = all(isinstance(p, Replicate) for p in x.placements)
            grad_placements = [Partial()] if replicated and isinstance(out_placements[0], Shard) else None
            x = x.to_local(grad_placements=grad_placements)
        y_local = fp8_linear(x, weight.to_local(), opts)
        return DTensor.from_local(y_local, weight.device_mesh, out_placements, run_check=False)
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    w = weight.to(x.dtype)  # the autocast / compute-dtype copy, as nn.Linear under autocast
    return _Fp8Linear.apply(x_MK, w, opts).view(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` (without bias) whose GEMMs run in FP8; the same parameters and state-dict keys.

    Built by :func:`lightning_moe.models.fp8_dense.convert_linears_to_fp8` from an existing layer.
    ``resolve(device)`` turns the model's ``Fp8Config`` into the settings for the device the layer
    runs on (at its first call there: a model is often built on CPU or meta and moved); ``None``
    runs the plain linear (``enabled="auto"`` where FP8 cannot run)."""

    fp8_resolve: Callable[[torch.device], Fp8Options | None]

    def _opts(self, device: torch.device) -> Fp8Options | None:
        cache = self.__dict__.setdefault("_fp8_opts", {})
        if device.type not in cache:
            cache[device.type] = self.fp8_resolve(device)
        return cache[device.type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        opts = self._opts(x.device)
        if opts is None:
            return super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
            with torch.autocast(x.device.type, enabled=False):
                return fp8_linear(x, self.weight, opts)
        return fp8_linear(x, self.weight, opts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=True"
