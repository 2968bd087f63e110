"""The router and the expert permutation of a dropless single-rank layer in one extension call.

Legend: T tokens, H hidden, E experts, K experts per token, R = T*K rows grouped by expert.

    logits_TE = x_TH @ w_EH^T               (fp32; csrc router_logits)
    ids_TK    = top-k selection(logits_TE)  (csrc router_topk: score function, expert bias, groups)
    perm      = stable sort of the slots by expert (csrc build_permutation)
    x_RH      = x_TH's rows in expert order (csrc scatter_rows)

Why one call: every step of a layer starts with these four, each a short kernel, and in a step
that begins after a host synchronisation the device idles until the host has issued them all and
reached the first expert GEMM. Issued from Python they cost four dispatcher round trips, the
objects between them and a cold cuBLAS call (H200, Qwen3-30B-A3B, `benchmarks/probes/host_path.py
--stages`: ~400 µs of host time from the router's GEMM to the rows' launch); one C++ call issues
the same kernels back to back. The results are the same tensors the four ops return one by one
(same kernels); only ``logits_TE`` carries autograd (to ``x_TH`` and ``w_EH``), the ids, the
permutation and the moved rows are constants of the step (the moved rows' gradient reaches
``x_TH`` through the experts' own node, which takes ``x_TH`` as its differentiable input).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from lightning_moe.ops.permute import Permutation, dropless_permutation
from lightning_moe.ops.router_gemm import router_logits_backward

__all__ = ["RoutedRows", "route"]


class RoutedRows(NamedTuple):
    logits_TE: torch.Tensor  # fp32, differentiable
    topk_ids_TK: torch.Tensor  # int64
    perm: Permutation
    x_RH: torch.Tensor  # x_TH's rows in expert order (no autograd)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x_TH: torch.Tensor,
        w_EH: torch.Tensor,
        ext: ModuleType,
        selection: tuple,
    ) -> tuple[torch.Tensor, ...]:
        outputs = ext.route(x_TH, w_EH, *selection)
        ctx.save_for_backward(x_TH, w_EH)
        ctx.mark_non_differentiable(*outputs[1:])
        # The moved rows get no gradient: without this autograd would hand backward a zero-filled
        # [R, H] tensor for them (a 0.16 ms fill per step on Qwen3-30B-A3B, seen in the profile).
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor | None, *unused: torch.Tensor | None):  # type: ignore[override]
        grad_x, grad_w = (None, None) if grad_TE is None else router_logits_backward(ctx, grad_TE)
        return grad_x, grad_w, None, None


def route(ext: ModuleType, x_TH: torch.Tensor, w_EH: torch.Tensor, selection: tuple) -> RoutedRows:
    """Logits, top-k ids, permutation and moved rows of ``x_TH`` (contiguous, bf16/fp16 like ``w_EH``).

    ``selection``: the top-k arguments after the logits, as ``TopKRouter._topk_kernel_args`` builds
    them for the separate ``router_topk`` call too (expert bias, top_k, score function, pre_softmax,
    norm_topk_prob, scaling factor, groups, group_topk); the bias gets no gradient.

    The caller checks that the extension applies (``TopKRouter.route_and_permute``); the
    extension raises with the argument and the fix otherwise.
    """
    logits_TE, ids_TK, src_R, slot_row_TK, counts_E, offsets_E, x_RH = _Route.apply(x_TH, w_EH, ext, selection)
    return RoutedRows(logits_TE, ids_TK, dropless_permutation(src_R, slot_row_TK, counts_E, offsets_E), x_RH)
