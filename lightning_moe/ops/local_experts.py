"""Permute → expert SwiGLU MLP → combine as one autograd function (the single-rank fast path).

Legend: T tokens, H hidden, F expert FFN width, E experts, K top-k, R rows grouped by expert.

    x_RH  = x_TH[src_R]                      # permute (each token's row scattered to its K rows)
    h_R2F = gmm(x_RH, w13) + b13             # [gate | up]; the bias optional
    a_RF  = silu(gate) * up * w_R            # weighted SwiGLU (memory-efficient permutation)
    y_RH  = gmm(a_RF, w2) + w_R * b2         # the down bias optional, weighted like the output
    y_TH  = sum_k y_RH[slot_row_TK[t, k]]    # combine (gather-sum, the weight is already in)

Why fused: as separate autograd nodes each piece keeps its own inputs alive across the step
(the permuted copy ``x_RH`` and the incoming ``grad_y_RH`` twice over) and hands ``grad_x_RH``
back to the engine. Here ``h_R2F`` is saved, plus — unless ``lean`` — ``x_RH`` and ``a_RF``
(lean re-gathers ``x_RH`` from the caller's ``x_TH`` and recomputes ``a_RF`` from ``h``); every
other R-sized buffer is freed after its last use. Two nodes rather than one, so that the engine
accumulates (and frees) ``grad_w2`` before ``grad_w13`` is allocated — with large experts the two
weight gradients are the biggest transient buffers of the step:

    _DownCombine (h, w2, w_R -> y_TH)      backward: grad_y_RH = grad_out[src_R] -> grad_a,
        grad_w2 (with a) -> grad_h, grad_w_R = swiglu_bwd(h, w_R, grad_a)
    _PermuteUp (x_TH, x_RH, w13 -> h)      backward: grad_w13 (with x_RH);
        grad_x_RH = gmm(grad_h, w13^T) -> grad_x_TH = gather-sum over the K slots

With ``fuse_wgrad`` (and a shape where it pays), a weight that already has a ``.grad`` gets its
gradient added there by the weight-gradient GEMMs themselves (``ops/wgrad/``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lightning_moe.ops.deferred import Deferred, resolved
from lightning_moe.ops.expert_bias import bias_grad, bias_rows, down_bias_grads, expert_of_rows
from lightning_moe.ops.grouped_gemm import GemmBackend, gmm, gmm_wgrad
from lightning_moe.ops.grouped_gemm_cutlass import DEFAULT_TILE
from lightning_moe.ops.permute import Permutation, _expert_rows_impl, _unpermute_sum_impl
from lightning_moe.ops.swiglu import PLAIN_SWIGLU, SwiGLUOptions, weighted_swiglu_backward, weighted_swiglu_forward
from lightning_moe.ops.wgrad import WgradFusion, accumulation_target, may_fuse

__all__ = ["local_experts"]


class _Kernels(NamedTuple):
    """The GEMM arguments of one call, resolved once: ``gmm(..., *gemm)``, ``gmm_wgrad(..., *wgrad)``."""

    gemm: tuple[GemmBackend, str, str]
    wgrad: tuple[GemmBackend]


class _ExpertMath(NamedTuple):
    """The optional parts of the expert MLP: its activation's constants and, with biases, each row's
    local expert (``ops.expert_bias.expert_of_rows``)."""

    opts: SwiGLUOptions = PLAIN_SWIGLU
    expert_R: torch.Tensor | None = None


class _PermuteUp(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_TH: torch.Tensor,
        x_RH: torch.Tensor,  # x_TH's rows in expert order (_expert_rows_impl), moved by the caller
        w13: torch.Tensor,
        perm: Permutation,
        offs_E: torch.Tensor,
        kernels: _Kernels,
        keep_gathered: bool,
        fusion: WgradFusion | None,
        b13: torch.Tensor | None,
        math: _ExpertMath,
    ) -> torch.Tensor:
        h_R2F = gmm(x_RH, w13, offs_E, *kernels.gemm)
        if b13 is not None:
            h_R2F.add_(bias_rows(b13, math.expert_R))
        ctx.perm, ctx.kernels, ctx.keep_gathered, ctx.math = perm, kernels, keep_gathered, math
        ctx.bias_shape = None if b13 is None else (b13.shape[0], b13.dtype)
        # The weight itself, not its saved copy: saved-tensor hooks (offload, checkpoints) may unpack
        # another tensor, and the in-place accumulation needs the leaf whose .grad autograd would fill.
        ctx.fusion, ctx.weight = fusion, (w13 if fusion is not None else None)
        ctx.save_for_backward(x_RH if keep_gathered else x_TH, w13, offs_E)
        return h_R2F

    @staticmethod
    def backward(ctx, grad_h_R2F: torch.Tensor):  # type: ignore[override]
        x_saved, w13, offs_E = ctx.saved_tensors
        perm: Permutation = ctx.perm
        kernels: _Kernels = ctx.kernels
        grad_h_R2F = grad_h_R2F.contiguous()
        grad_w13 = None
        if ctx.needs_input_grad[2]:  # w13 (x_RH, input 1, is the caller's detached copy)
            x_RH = x_saved if ctx.keep_gathered else _expert_rows_impl(x_saved, perm)
            grad_w13 = _weight_grad(ctx, x_RH, grad_h_R2F, offs_E, "w13")
            del x_RH
        grad_x_TH = None
        if ctx.needs_input_grad[0]:
            grad_x_RH = gmm(grad_h_R2F, w13.transpose(1, 2), offs_E, *kernels.gemm)
            grad_x_TH = _unpermute_sum_impl(grad_x_RH, perm.slot_row_TK, None)
        grad_b13 = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[8]:
            grad_b13 = bias_grad(grad_h_R2F, ctx.math.expert_R, *ctx.bias_shape)
        return grad_x_TH, None, grad_w13, None, None, None, None, None, grad_b13, None


class _DownCombine(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h_R2F: torch.Tensor,
        w2: torch.Tensor,
        w_R: torch.Tensor,
        perm: Permutation,
        offs_E: torch.Tensor,
        kernels: _Kernels,
        keep_activation: bool,
        fusion: WgradFusion | None,
        b2: torch.Tensor | None,
        math: _ExpertMath,
    ) -> torch.Tensor:
        a_RF = weighted_swiglu_forward(h_R2F, w_R, math.opts)
        y_RH = gmm(a_RF, w2, offs_E, *kernels.gemm)
        if b2 is not None:  # y = w * (a @ w2 + b2), with w already inside a
            b2_RH = bias_rows(b2, math.expert_R)
            y_RH.add_(b2_RH if w_R is None else b2_RH * w_R.unsqueeze(-1).to(b2_RH.dtype))
        y_TH = _unpermute_sum_impl(y_RH, perm.slot_row_TK, None)
        ctx.perm, ctx.kernels, ctx.math = perm, kernels, math
        ctx.fusion, ctx.weight = fusion, (w2 if fusion is not None else None)
        ctx.save_for_backward(h_R2F, w2, w_R, offs_E, a_RF if keep_activation else None, b2)
        return y_TH

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):  # type: ignore[override]
        h_R2F, w2, w_R, offs_E, a_RF, b2 = ctx.saved_tensors
        perm: Permutation = ctx.perm
        kernels: _Kernels = ctx.kernels
        math: _ExpertMath = ctx.math
        grad_y_RH = _expert_rows_impl(grad_TH, perm)
        need_b2, need_w = ctx.needs_input_grad[8], ctx.needs_input_grad[2]
        grad_b2, grad_w_from_b2 = down_bias_grads(grad_y_RH, w_R, b2, math.expert_R, need_b2, need_w)
        grad_w2 = None
        if ctx.needs_input_grad[1]:  # before grad_a_RF exists: a_RF is freed first (lower peak)
            if a_RF is None:
                a_RF = weighted_swiglu_forward(h_R2F, w_R, math.opts)
            grad_w2 = _weight_grad(ctx, a_RF, grad_y_RH, offs_E, "w2")
            del a_RF
        grad_a_RF = gmm(grad_y_RH, w2.transpose(1, 2), offs_E, *kernels.gemm)
        del grad_y_RH
        grad_h_R2F, grad_w_R = weighted_swiglu_backward(h_R2F, w_R, grad_a_RF, ctx.needs_input_grad[2], math.opts)
        if grad_w_R is not None:
            grad_w_R = (grad_w_R if grad_w_from_b2 is None else grad_w_R + grad_w_from_b2).to(w_R.dtype)
        return grad_h_R2F, grad_w2, grad_w_R, None, None, None, None, None, grad_b2, None


def _weight_grad(ctx, x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor, weight: str) -> torch.Tensor | None:  # noqa: ANN001
    """The expert weight gradient to return, or ``None`` once it was added into ``.grad`` in place."""
    target = accumulation_target(ctx.weight) if ctx.fusion is not None else None
    if target is None:
        return gmm_wgrad(x_RD, dy_RO, offs_E, *ctx.kernels.wgrad)
    ctx.fusion.accumulate_(target, x_RD, dy_RO, weight)
    return None


# The automatic keep-or-rebuild choice assumes a machine balance of about 200 bf16 tensor FLOPs
# per byte of device memory traffic (H100/H200: ~790 TFLOP/s over ~4 TB/s) and rebuilds a buffer
# when that costs under 2.5 % of the layer's expert GEMM time.
_FLOPS_PER_BYTE = 200.0
_CHEAP_FRACTION = 0.025


def rebuild_is_cheap(hidden_size: int, ffn_hidden_size: int) -> tuple[bool, bool]:
    """Whether re-gathering ``x_RH`` and recomputing ``a_RF`` in backward are cheap for this shape.

    Per row the expert GEMMs do 18*H*F FLOPs (forward and backward); the re-gather moves 4*H
    bytes (bf16 read and write), the SwiGLU recompute 6*F (read ``h``, write ``a``). Wide experts
    (DeepSeek-V3, Mixtral) rebuild both for free in practice; fine-grained ones (Qwen3-30B-A3B:
    6 % and 3 %) keep them.
    """
    gemm_flops = 18.0 * hidden_size * ffn_hidden_size
    x_cost = 4.0 * hidden_size * _FLOPS_PER_BYTE / gemm_flops
    a_cost = 6.0 * ffn_hidden_size * _FLOPS_PER_BYTE / gemm_flops
    return x_cost < _CHEAP_FRACTION, a_cost < _CHEAP_FRACTION


def _rows_in_expert_order(x_TH: torch.Tensor, perm: Permutation, x_RH: Deferred | None) -> torch.Tensor:
    """The caller's rows ``x_RH`` when given in ``x_TH``'s dtype, else ``x_TH``'s rows in ``perm``'s order."""
    x_RH = None if x_RH is None else resolved(x_RH)
    if x_RH is None or x_RH.dtype != x_TH.dtype:
        x_RH = _expert_rows_impl(x_TH.detach(), perm)
    return x_RH


def _what_to_rebuild(lean: bool | None, hidden_size: int, ffn_hidden_size: int) -> tuple[bool, bool]:
    """Whether backward rebuilds the gathered rows and the activation (``lean``; ``None``: where cheap)."""
    if lean is None:
        return rebuild_is_cheap(hidden_size, ffn_hidden_size)
    return lean, lean


def local_experts(
    x_TH: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w_R: Deferred,
    perm: Permutation,
    offs_E: torch.Tensor,
    backend: GemmBackend = "torch",
    lean: bool | None = False,
    fuse_wgrad: bool = False,
    x_RH: Deferred | None = None,
    gemm_kernel: str = "auto",
    gemm_tile: str = DEFAULT_TILE,
    wgrad_kernel: str = "auto",
    wgrad_streams: tuple[int, int] = (2, 2),
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    opts: SwiGLUOptions = PLAIN_SWIGLU,
) -> torch.Tensor:
    """``y_TH`` of all experts on this rank, routing weights applied inside the SwiGLU.

    ``lean=False`` (speed) keeps the gathered rows ``x_RH`` and the activation ``a_RF`` for
    backward; ``lean=True`` keeps neither (one more gather and one more SwiGLU in backward, R*(H+F)
    fewer values held) — what activation recompute asks for; ``None`` rebuilds each one whose
    rebuild is cheap for the shape (:func:`rebuild_is_cheap`).

    ``fuse_wgrad=True``: when ``w13``/``w2`` are leaves that already hold a ``.grad`` at backward
    time and the shape is wide enough for it to pay (``ops.wgrad.wide_experts``), their
    gradients are added into ``.grad`` by the weight-gradient GEMMs (see that module for when it is
    safe); otherwise, and by default, they are returned to autograd.

    ``x_RH``: ``x_TH``'s rows in ``perm``'s order, already moved by the caller (no autograd; the
    gradient reaches ``x_TH``), or a ``TakeOnce`` of them: then this frame holds the only reference
    and they are freed right after the first GEMM unless kept for backward (with wide experts
    they are the largest buffer of the forward); moved here when ``None`` or of another dtype.

    ``gemm_kernel``, ``gemm_tile``, ``wgrad_kernel``, ``wgrad_streams`` (``w13``, ``w2``): the
    resolved ``KernelConfig`` values (``ops/grouped_gemm.py`` and ``ops/wgrad/`` say what they choose).

    ``b13 [E, 2F]``, ``b2 [E, H]``: optional biases of the two projections; ``opts``: the
    activation's constants (:class:`~lightning_moe.ops.swiglu.SwiGLUOptions`).
    """
    # The rows are moved first: the device copies them while the host sets up the fusion and the
    # autograd node below (host time before the first GEMM's launch is time the GPU sits idle).
    x_RH = _rows_in_expert_order(x_TH, perm, x_RH)
    rebuild_x, rebuild_a = _what_to_rebuild(lean, x_TH.shape[-1], w2.shape[-2])
    fusion = None
    if fuse_wgrad and may_fuse(wgrad_kernel, w13, w2, x_TH):
        fusion = WgradFusion(offs_E, x_TH, (w13, w2), wgrad_kernel, wgrad_streams)
    kernels = _Kernels((backend, gemm_kernel, gemm_tile), (backend,))
    biased = b13 is not None or b2 is not None
    math = _ExpertMath(opts, expert_of_rows(offs_E, x_RH.shape[0]) if biased else None)
    h_R2F = _PermuteUp.apply(x_TH, x_RH, w13, perm, offs_E, kernels, not rebuild_x, fusion, b13, math)
    del x_RH  # held by the node only when it keeps the gathered rows
    if fusion is not None:
        fusion.copy_offsets()
    w_R = resolved(w_R)  # deferred by the caller until the first GEMM is launched
    return _DownCombine.apply(h_R2F, w2, w_R, perm, offs_E, kernels, not rebuild_a, fusion, b2, math)
