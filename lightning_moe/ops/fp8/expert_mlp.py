"""The expert SwiGLU MLP with FP8 GEMMs, forward and backward (grouped rows, and the fused local path).

Legend: T tokens, R rows grouped by expert, H hidden, F expert FFN width, E local experts.
``q(t, along)``: ``t`` quantized (``ops/fp8/quantize.py``) in units constant along the contracted
dim; ``qg(t)``: quantized in units along the rows of each expert segment (``quantize_grouped_rows``).

    forward                                   backward (gradients in ``grad_format``)
    h_R2F = gmm(q(x_RH), q(w13))              grad_a_RF = gmm(q(dy_RH), q(w2^T))
    a_RF  = silu(gate) * up * w_R             grad_w2   = wgrad(qg(a_RF), qg(dy_RH))
    y_RH  = gmm(q(a_RF), q(w2))               grad_h, grad_w_R = swiglu_backward(h, w_R, grad_a)
                                              grad_x_RH = gmm(q(grad_h), q(w13^T))
                                              grad_w13  = wgrad(qg(x_RH), qg(grad_h))

Activations and gradients are quantized along their last dim (blockwise: 1 x 128 tiles; the csrc
row kernels on CUDA, ``ops/fp8/kernels.py``: ``q(a_RF)`` straight from the SwiGLU, the local
path's rows from the tokens), the weights along their input dim for the forward and along their
output dim for the data gradient (blockwise: 128 x 128 tiles), each from the master copy once per
weight version with ``cache_weights`` (``ops/fp8/weight_cache.py``), else in every call. The
weight gradients ``wgrad`` run at ``Fp8Options.wgrad``'s precision (``ops/fp8/choice.py``):
``fp8`` as drawn, or ``activation``: ``gmm_wgrad`` of the unquantized ``a_RF``/``x_RH`` (the saved
FP8 rows widened) and gradients in the activation dtype. The data gradients are written in the
activation dtype (as the bf16 experts write them) and cast to the input's dtype. The routing
weight stays inside the SwiGLU, in fp32, as in the bf16 path (``ops/expert_mlp.py``); the SwiGLU
itself is not quantized.

Saved for backward (``save_fp8_activations``): the FP8 rows ``q(x_RH)`` and an FP8 copy of the
SwiGLU input ``q(h_R2F)`` (DeepSeek-V3 keeps both in FP8); backward dequantizes them, recomputes
``a_RF`` from ``h`` and quantizes what its GEMMs need. Otherwise ``x_RH`` (or, on the local path,
the caller's ``x_TH``, gathered again) and ``h_R2F`` are kept in the activation dtype. Rows that
arrive in FP8 from the token exchange (``x_fp8``) are used as they are, never re-quantized.

Two autograd nodes, as in the bf16 fused path (``ops/local_experts.py``): the engine accumulates and
frees ``grad_w2`` before ``grad_w13`` is allocated.

FP8 tensors are saved as ``uint8`` views: saved-tensor hooks (offload, activation recompute) see
bytes, never a floating tensor they might take for the activation-dtype hidden state.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch

from lightning_moe.ops.deferred import Deferred, resolved
from lightning_moe.ops.fp8 import kernels
from lightning_moe.ops.fp8.choice import local_rows_plan, resolve_wgrad_precision
from lightning_moe.ops.fp8.gemm import fp8_grouped_mm, fp8_grouped_wgrad, resolve_fp8_backend
from lightning_moe.ops.fp8.quantize import Fp8Tensor, quantize_grouped_rows
from lightning_moe.ops.fp8.weight_cache import WeightUse, quantized_weight
from lightning_moe.ops.grouped_gemm import gmm_wgrad, resolve_gemm_backend
from lightning_moe.ops.permute import Permutation, _expert_rows_impl, _unpermute_sum_impl
from lightning_moe.ops.swiglu import weighted_swiglu_backward, weighted_swiglu_forward
from lightning_moe.ops.wgrad import accumulation_target

__all__ = [
    "FP8_MIN_EXPERT_HF",
    "Fp8Options",
    "dequantized_rows",
    "fp8_expert_swiglu_mlp",
    "fp8_local_experts",
    "fp8_options",
    "fp8_pays",
]

# enabled="auto" runs FP8 from this expert size (H * F) on; None: on no shape yet (see fp8_pays).
FP8_MIN_EXPERT_HF: int | None = None


def fp8_pays(hidden_size: int, ffn_hidden_size: int) -> bool:
    """Whether the FP8 experts step is faster than bf16 for experts of this shape (``enabled="auto"``).

    ``auto`` must never be slower than bf16, so it follows the whole experts step (forward and
    backward, quantization included), not the GEMMs alone. The GEMMs alone favour FP8 on wide
    experts: measured on the H200 (rowwise recipe, grouped GEMM), H = 2880, F = 2880 is 1.6x faster
    in FP8, while the fine-grained Qwen3-30B-A3B shape H = 2048, F = 768 is slower. The whole step
    (``benchmarks/probes/fp8_experts_shapes.py``, H200, torch backend, bf16 activations) is slower on
    every shape measured, because the operands were quantized by torch ops (``ops/fp8/quantize.py``;
    one weight alone took 6-12 ms at 2880 x 2880): 81.9 ms rowwise vs 8.4 ms bf16 at 2880 x 2880
    (32 experts, 32768 rows), 91.2 vs 7.2 ms at DeepSeek-V3's shape (32 local experts, 16384 rows),
    117.7 vs 6.3 ms at Qwen3-30B-A3B's (128 experts, 131072 rows); measured before the csrc
    quantization kernels, the CUTLASS blockwise default, the weight cache and the activation-dtype
    weight gradients were on this path. So ``FP8_MIN_EXPERT_HF`` is
    ``None``: ``auto`` keeps every shape in bf16 until a shape measures faster in FP8; then the rule
    is ``H * F >= FP8_MIN_EXPERT_HF``. ``enabled="on"`` runs FP8 whatever the shape.
    """
    if FP8_MIN_EXPERT_HF is None:
        return False
    return hidden_size * ffn_hidden_size >= FP8_MIN_EXPERT_HF


class Fp8Options(NamedTuple):
    """One layer's resolved FP8 settings (from ``Fp8Config`` and the device)."""

    recipe: str
    grad_format: str
    pow2_scales: bool
    backend: str  # resolved: "emulate", "torch" or "cutlass"
    save_fp8_activations: bool
    wgrad: str = "fp8"  # resolved (ops/fp8/choice.py): "fp8" or "activation"
    cache_weights: bool = False  # reuse FP8 weights until the weight changes (ops/fp8/weight_cache.py)


def fp8_options(fp8: object, device: torch.device, hidden_size: int, ffn_hidden_size: int) -> Fp8Options | None:
    """The FP8 settings one layer runs with on ``device``, or ``None`` for bf16 experts.

    ``fp8`` is a ``lightning_moe.config.Fp8Config`` or ``None``. ``enabled="on"`` raises (a
    ``ValueError`` naming the fix) when the device cannot run the requested backend;
    ``enabled="auto"`` chooses bf16 where :func:`fp8_pays` says FP8 is slower, on CPU unless
    ``backend="emulate"`` was asked for, and (with a warning) on a GPU that cannot run FP8.
    """
    if fp8 is None or fp8.enabled == "off":
        return None
    if fp8.enabled == "auto":
        if not fp8_pays(hidden_size, ffn_hidden_size):
            return None
        if device.type != "cuda" and fp8.backend != "emulate":
            return None
        try:
            backend = resolve_fp8_backend(fp8.backend, device, fp8.recipe)
        except ValueError as err:
            warnings.warn(f"Fp8Config(enabled='auto'): the experts run in bf16 on this device: {err}", stacklevel=3)
            return None
    else:
        backend = resolve_fp8_backend(fp8.backend, device, fp8.recipe)
    wgrad = resolve_wgrad_precision(fp8.wgrad, backend)
    return Fp8Options(
        fp8.recipe, fp8.grad_format, fp8.pow2_scales, backend, fp8.save_fp8_activations, wgrad, fp8.cache_weights
    )


# ----------------------------------------------------------------------------------------------
# Quantization of the operands


def quantize_rows(t_RK: torch.Tensor, opts: Fp8Options, fmt: str = "e4m3") -> Fp8Tensor:
    """An activation or gradient ``[R, K]`` for a GEMM contracting over K (blockwise: 1 x 128 tiles);
    the csrc row kernel on CUDA, ``quantize`` elsewhere (the same numbers)."""
    return kernels.quantize_rows_fp8(t_RK, opts.recipe, fmt, pow2_scales=opts.pow2_scales)  # type: ignore[arg-type]


def quantize_weight(w_EKN: torch.Tensor, opts: Fp8Options, use: WeightUse = "fprop") -> Fp8Tensor:
    """An expert weight ``[E, K, N]`` as the forward's operand (contracted over K) or, ``use="dgrad"``,
    its transpose ``[E, N, K]`` as the data gradient's (blockwise: 128 x 128 tiles); cached per
    weight version with ``opts.cache_weights``."""
    return quantized_weight(w_EKN, use, opts.recipe, opts.pow2_scales, opts.cache_weights)


def activation_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``x_e^T @ dy_e`` per expert in the activation dtype: the bf16 experts' weight-gradient GEMM
    (``ops.grouped_gemm.gmm_wgrad``, its ``auto`` kernel), no host sync on the torch backend."""
    backend, _ = resolve_gemm_backend("auto", x_RK.device, x_RK.dtype, (x_RK.shape[1], dy_RN.shape[1]))
    return gmm_wgrad(x_RK.contiguous(), dy_RN.contiguous(), offs_E, backend)


def _wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offs_E: torch.Tensor, opts: Fp8Options, out_dtype: torch.dtype) -> torch.Tensor:
    """One weight gradient ``[E, K, N]`` in ``out_dtype``, at ``opts.wgrad``'s precision."""
    if opts.wgrad == "activation":  # in the gradient's dtype (the activation dtype), as the bf16 experts
        return activation_wgrad(x_RK.to(dy_RN.dtype), dy_RN, offs_E).to(out_dtype)
    x_seg = quantize_segments(x_RK, offs_E, opts)
    dy_seg = quantize_segments(dy_RN, offs_E, opts, opts.grad_format)
    return fp8_grouped_wgrad(x_seg, dy_seg, offs_E, out_dtype, opts.backend)


def quantize_segments(t_RK: torch.Tensor, offs_E: torch.Tensor, opts: Fp8Options, fmt: str = "e4m3") -> Fp8Tensor:
    """An operand of a weight-gradient GEMM: units along the rows of each expert segment."""
    return quantize_grouped_rows(t_RK, offs_E, opts.recipe, fmt, pow2_scales=opts.pow2_scales)


def _pack(t: Fp8Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], Fp8Tensor]:
    """The tensors to save (the data as ``uint8``) and a data-free template to rebuild ``t`` from."""
    meta = dataclasses.replace(t, data=t.data[:0], scale=t.scale[:0])
    return (t.data.view(torch.uint8), t.scale), meta


def _unpack(meta: Fp8Tensor, data_u8: torch.Tensor, scale: torch.Tensor) -> Fp8Tensor:
    return dataclasses.replace(meta, data=data_u8.view(meta.data.dtype), scale=scale)


def _weight_grad(ctx, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:  # noqa: ANN001
    """The weight gradient to return, or ``None`` once it was added into ``weight.grad``."""
    if not ctx.fuse_wgrad:
        return grad
    target = accumulation_target(weight)
    if target is None:
        return grad
    target.add_(grad)
    return None


# ----------------------------------------------------------------------------------------------
# The two autograd nodes. ``perm`` set: the fused local path (x_TH in token order in, y_TH out);
# ``perm`` None: grouped rows in and out.


class _Fp8Up(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_in: torch.Tensor,  # x_RH (grouped rows; possibly the exchange's placeholder) or x_TH (perm set)
        w13: torch.Tensor,
        x_fp8: Fp8Tensor,  # the rows in expert order, quantized along H
        saved_fp8: Fp8Tensor | None,  # what to keep of the rows in FP8 (x_fp8, or x_TH's FP8 rows), or None
        perm: Permutation | None,
        offs_E: torch.Tensor,
        opts: Fp8Options,
        out_dtype: torch.dtype,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        h_R2F = fp8_grouped_mm(x_fp8, quantize_weight(w13, opts), offs_E, out_dtype, opts.backend)
        ctx.perm, ctx.opts, ctx.fuse_wgrad = perm, opts, fuse_wgrad
        ctx.x_dtype, ctx.act_dtype = x_in.dtype, out_dtype
        ctx.weight = w13 if fuse_wgrad else None  # the leaf itself (see ops/local_experts.py)
        ctx.gather_saved = perm is not None and saved_fp8 is not None and saved_fp8 is not x_fp8  # x_TH's rows
        if saved_fp8 is not None:
            (data, scale), ctx.meta = _pack(saved_fp8)
            ctx.save_for_backward(data, scale, w13, offs_E)
        else:
            ctx.meta = None
            ctx.save_for_backward(x_in, None, w13, offs_E)
        return h_R2F

    @staticmethod
    def backward(ctx, grad_h_R2F: torch.Tensor):  # type: ignore[override]
        first, scale, w13, offs_E = ctx.saved_tensors
        opts: Fp8Options = ctx.opts
        perm: Permutation | None = ctx.perm
        grad_h_R2F = grad_h_R2F.contiguous()
        grad_w13 = None
        if ctx.needs_input_grad[1]:
            if ctx.meta is not None:
                saved = _unpack(ctx.meta, first, scale)
                if ctx.gather_saved:  # the T tokens' FP8 rows: dequantized, then moved (K times fewer to widen)
                    x_RH = _expert_rows_impl(saved.dequantize(ctx.act_dtype), perm)
                else:
                    x_RH = saved.dequantize(ctx.act_dtype)
            else:
                x_RH = first if perm is None else _expert_rows_impl(first, perm)
            grad = _wgrad(x_RH, grad_h_R2F, offs_E, opts, w13.dtype)
            del x_RH
            grad_w13 = _weight_grad(ctx, ctx.weight if ctx.fuse_wgrad else w13, grad)
        grad_x = None
        if ctx.needs_input_grad[0]:
            w13_t = quantize_weight(w13, opts, "dgrad")  # contracted over 2F now
            # in the activation dtype, as the bf16 experts write it (a cast back to x's dtype after)
            grad_x = fp8_grouped_mm(quantize_rows(grad_h_R2F, opts, opts.grad_format), w13_t, offs_E, ctx.act_dtype, opts.backend)
            if perm is not None:
                grad_x = _unpermute_sum_impl(grad_x, perm.slot_row_TK, None)
            grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, grad_w13, None, None, None, None, None, None, None


class _Fp8Down(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h_R2F: torch.Tensor,
        w2: torch.Tensor,
        w_R: torch.Tensor | None,
        perm: Permutation | None,
        offs_E: torch.Tensor,
        opts: Fp8Options,
        fuse_wgrad: bool,
    ) -> torch.Tensor:
        # the SwiGLU written straight to FP8 (the csrc fused kernel on CUDA): a_RF is never stored
        a_fp8 = kernels.swiglu_quantize(h_R2F, w_R, opts.recipe, "e4m3", pow2_scales=opts.pow2_scales)  # type: ignore[arg-type]
        y = fp8_grouped_mm(a_fp8, quantize_weight(w2, opts), offs_E, h_R2F.dtype, opts.backend)
        del a_fp8
        if perm is not None:
            y = _unpermute_sum_impl(y, perm.slot_row_TK, None)
        ctx.perm, ctx.opts, ctx.fuse_wgrad = perm, opts, fuse_wgrad
        ctx.act_dtype, ctx.weight = h_R2F.dtype, (w2 if fuse_wgrad else None)
        if opts.save_fp8_activations:
            (data, scale), ctx.meta = _pack(quantize_rows(h_R2F, opts))
            ctx.save_for_backward(data, scale, w2, w_R, offs_E)
        else:
            ctx.meta = None
            ctx.save_for_backward(h_R2F, None, w2, w_R, offs_E)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        first, scale, w2, w_R, offs_E = ctx.saved_tensors
        opts: Fp8Options = ctx.opts
        perm: Permutation | None = ctx.perm
        h_R2F = first if ctx.meta is None else _unpack(ctx.meta, first, scale).dequantize(ctx.act_dtype)
        grad_y_RH = grad_out.contiguous() if perm is None else _expert_rows_impl(grad_out, perm)
        grad_w2 = None
        if ctx.needs_input_grad[1]:
            a_RF = weighted_swiglu_forward(h_R2F, w_R)
            grad = _wgrad(a_RF, grad_y_RH, offs_E, opts, w2.dtype)
            del a_RF
            grad_w2 = _weight_grad(ctx, ctx.weight if ctx.fuse_wgrad else w2, grad)
        w2_t = quantize_weight(w2, opts, "dgrad")  # contracted over H now
        grad_a_RF = fp8_grouped_mm(quantize_rows(grad_y_RH, opts, opts.grad_format), w2_t, offs_E, ctx.act_dtype, opts.backend)
        del grad_y_RH, w2_t
        need_w = w_R is not None and ctx.needs_input_grad[2]
        grad_h_R2F, grad_w_R = weighted_swiglu_backward(h_R2F, w_R, grad_a_RF, need_w)
        if grad_w_R is not None:
            grad_w_R = grad_w_R.to(w_R.dtype)
        return grad_h_R2F, grad_w2, grad_w_R, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Entry points


def _check_rows(x_fp8: Fp8Tensor, x_RH: torch.Tensor, opts: Fp8Options) -> None:
    if not isinstance(x_fp8, Fp8Tensor):
        raise TypeError(f"fp8 experts: x_fp8 is a {type(x_fp8).__name__}, not an Fp8Tensor; pass quantize(...)'s result or None.")
    if tuple(x_fp8.shape) != tuple(x_RH.shape):
        raise ValueError(
            f"fp8 experts: x_fp8 has shape {tuple(x_fp8.shape)} but x_RH has {tuple(x_RH.shape)}; "
            "pass the FP8 rows of the same dispatched rows."
        )
    if x_fp8.recipe != opts.recipe or x_fp8.reduce_dim != -1 or x_fp8.fmt != "e4m3":
        raise ValueError(
            f"fp8 experts: x_fp8 is {x_fp8.recipe!r} {x_fp8.fmt} along dim {x_fp8.reduce_dim}, the experts run "
            f"Fp8Config(recipe={opts.recipe!r}) with e4m3 rows along H; configure the dispatcher's FP8 rows "
            "with the experts' recipe."
        )


class _DequantizedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, x_fp8: Fp8Tensor) -> torch.Tensor:  # type: ignore[override]
        return x_fp8.dequantize(x_RH.dtype)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        return grad_RH, None


def dequantized_rows(x_RH: torch.Tensor, x_fp8: Fp8Tensor) -> torch.Tensor:
    """``x_fp8``'s rows in ``x_RH``'s dtype, differentiable as if they were ``x_RH`` (its stand-in)."""
    if not isinstance(x_fp8, Fp8Tensor) or tuple(x_fp8.shape) != tuple(x_RH.shape):
        raise ValueError(
            f"experts: x_fp8={type(x_fp8).__name__} does not hold the rows of x_RH {tuple(x_RH.shape)}; "
            "pass the FP8 rows of the same dispatched rows, or None."
        )
    return _DequantizedRows.apply(x_RH, x_fp8)


def fp8_expert_swiglu_mlp(
    x_RH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    offs_E: torch.Tensor,
    w_R: torch.Tensor | None,
    opts: Fp8Options,
    out_dtype: torch.dtype,
    x_fp8: Fp8Tensor | None = None,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by ``offs_E`` (inclusive int32 cumsum) with FP8 GEMMs; differentiable.

    ``w13``/``w2`` are the master weights (any float dtype; their gradients come back in it),
    ``out_dtype`` the activation dtype of ``h`` and ``y``. ``x_fp8``: the rows already in FP8
    (from the token exchange); ``x_RH`` is then only the differentiable stand-in for them (it may
    be a zero-stride placeholder) and receives the real ``[R, H]`` input gradient.
    ``fuse_wgrad``: add the weight gradients into an existing ``.grad`` instead of returning them
    (where the engine would have done exactly that: ``ops.wgrad.accumulation_target``).
    """
    if x_fp8 is None:
        x_fp8 = quantize_rows(x_RH, opts)
        saved = x_fp8 if opts.save_fp8_activations else None
    else:
        _check_rows(x_fp8, x_RH, opts)
        saved = x_fp8  # the only copy of the rows
    fuse_wgrad = fuse_wgrad and torch.is_grad_enabled()
    h_R2F = _Fp8Up.apply(x_RH, w13, x_fp8, saved, None, offs_E, opts, out_dtype, fuse_wgrad)
    return _Fp8Down.apply(h_R2F, w2, w_R, None, offs_E, opts, fuse_wgrad)


def fp8_local_experts(
    x_TH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w_R: Deferred,
    perm: Permutation,
    offs_E: torch.Tensor,
    opts: Fp8Options,
    out_dtype: torch.dtype,
    x_RH: torch.Tensor | None = None,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """``y_TH`` of all experts on this rank (permute and combine fused in) with FP8 GEMMs.

    The FP8 counterpart of ``ops.local_experts.local_experts``. Rowwise and blockwise quantize
    the T tokens once and gather their FP8 rows (a token's row and its scales travel together:
    the same numbers as quantizing the R gathered rows, K times less work, and ``x_RH`` is not
    needed); tensorwise quantizes the gathered rows ``x_RH`` (moved here when ``None``).
    ``w_R`` may be a function: it is called once the first expert GEMM is launched.
    """
    plan = local_rows_plan(opts.recipe, opts.save_fp8_activations)
    if plan == "gather_quantized_tokens":
        x_TK_fp8 = quantize_rows(x_TH.detach(), opts)
        x_fp8 = x_TK_fp8.index_rows(perm.src_token_R)
        saved = x_TK_fp8  # T rows, gathered again in backward
    elif plan == "permute_quantize":
        x_fp8 = kernels.permute_quantize(x_TH.detach(), perm.src_token_R, opts.recipe, "e4m3", pow2_scales=opts.pow2_scales)  # type: ignore[arg-type]
        saved = None
    else:
        if x_RH is None or x_RH.dtype != x_TH.dtype:
            x_RH = _expert_rows_impl(x_TH.detach(), perm)
        x_fp8 = quantize_rows(x_RH, opts)
        saved = x_fp8 if opts.save_fp8_activations else None
    del x_RH
    fuse_wgrad = fuse_wgrad and torch.is_grad_enabled()
    h_R2F = _Fp8Up.apply(x_TH, w13, x_fp8, saved, perm, offs_E, opts, out_dtype, fuse_wgrad)
    w_R = resolved(w_R)  # deferred by the caller until the first GEMM is launched
    return _Fp8Down.apply(h_R2F, w2, w_R, perm, offs_E, opts, fuse_wgrad)
