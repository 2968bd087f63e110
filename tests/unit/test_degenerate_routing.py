"""Degenerate routings through every one-process op and the local dispatcher, forward and backward.

The cases: an empty micro-batch (T = 0), every slot dropped (no rows at all), experts that get no
row, every token on one expert, and a rank's share that is empty. Each result (outputs, the input
gradient, the routing-weight gradient and both expert-weight gradients) is compared with a plain
PyTorch loop over tokens and slots in float64.

Legend: T tokens, H hidden, F expert FFN width, E experts, K slots per token, R rows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.grouped_gemm import gmm, gmm_wgrad, offsets_from_counts
from lightning_moe.ops.permute import (
    build_permutation,
    permute_rows,
    unpermute_sum,
    unpermute_sum_reference,
    unpermute_weight_grad_reference,
)
from lightning_moe.ops.swiglu import weighted_swiglu

H, FF, E, K = 8, 6, 4, 2


def _ids(case: str, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if case == "one_expert":  # every kept slot on expert 2, the second slot dropped
        return torch.stack([torch.full((T,), 2), torch.full((T,), -1)], 1)
    if case == "all_dropped":
        return torch.full((T, K), -1)
    if case == "empty_experts":  # experts 0 and 3 get nothing
        return torch.stack([torch.ones(T, dtype=torch.long), torch.full((T,), 2)], 1)
    if case == "skewed":  # mostly expert 3, some drops
        ids = torch.where(torch.rand(T, K, generator=g) < 0.8, 3, torch.randint(0, E, (T, K), generator=g))
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], -1, ids[:, 1])
        return ids
    return torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]  # K distinct experts per token


CASES = [("empty_batch", 0), ("one_expert", 5), ("all_dropped", 4), ("empty_experts", 6), ("skewed", 9), ("uniform", 7)]


def _inputs(case: str, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = _ids(case, T)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.rand(T, K, generator=g, dtype=torch.float64) * (ids >= 0)
    c = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, ids, w, c


def _reference(x, ids, w, experts):  # noqa: ANN001, ANN202  (the spec: one token, one slot at a time)
    w13, w2 = experts.w13, experts.w2
    out = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(H)
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = (x[t] @ w13[e]).chunk(2)
            acc = acc + w[t, k] * ((F.silu(gate) * up) @ w2[e])
        out.append(acc)
    return torch.stack(out) if out else x.new_zeros(0, H)


def _grads(fn: Callable, x, ids, w, c):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(3)
    experts = GroupedExperts(E, H, FF, backend="loop").double()
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, H, 2 * FF, generator=g, dtype=torch.float64))
        experts.w2.copy_(torch.randn(E, FF, H, generator=g, dtype=torch.float64))
    xl, wl = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = fn(xl, ids, wl, experts)
    if y.requires_grad:  # the token loop over no tokens builds no graph
        (y * c).sum().backward()
    leaves = (xl, wl, experts.w13, experts.w2)
    return [y.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def _check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, a, b in zip(("y", "grad x", "grad w", "grad w13", "grad w2"), got, want):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{name}: not finite"
        # the SwiGLU runs in fp32 whatever the input dtype (its spec): agreement to ~1e-6, not fp64's
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _via_dispatcher(fused: bool, weighted_inside: bool) -> Callable:
    def fn(x, ids, w, experts):  # noqa: ANN001, ANN202
        disp = LocalDispatcher(E, dropless=False)
        if fused:
            return disp.run_experts(x, ids, lambda: w, None, experts)
        d, handle = disp.dispatch(x, ids, w, None)
        y_R = experts(d.x_RH, d.tokens_per_expert_e, d.weights_R if weighted_inside else None)
        return disp.combine(y_R, handle, weighted=not weighted_inside)

    return fn


@pytest.mark.parametrize("case,T", CASES, ids=[c for c, _ in CASES])
@pytest.mark.parametrize("path", ["dispatch_combine", "dispatch_weighted_rows", "run_experts"])
def test_local_dispatcher_matches_token_loop_on_degenerate_routing(case: str, T: int, path: str) -> None:
    x, ids, w, c = _inputs(case, T)
    fn = _via_dispatcher(fused=path == "run_experts", weighted_inside=path == "dispatch_weighted_rows")
    _check(_grads(fn, x, ids, w, c), _grads(_reference, x, ids, w, c))


@pytest.mark.parametrize("case,T", CASES, ids=[c for c, _ in CASES])
def test_permute_and_gather_sum_match_loops_on_degenerate_routing(case: str, T: int) -> None:
    x, ids, w, c = _inputs(case, T)
    perm = build_permutation(ids, E)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x_RH = permute_rows(xl, perm)
    assert x_RH.shape == (int((ids >= 0).sum()), H)
    y = unpermute_sum(x_RH * 2.0, perm, wl)
    (y * c).sum().backward()
    want = (2.0 * w * (ids >= 0)).sum(1, keepdim=True) * x
    torch.testing.assert_close(y, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(xl.grad, (2.0 * w * (ids >= 0)).sum(1, keepdim=True) * c, rtol=1e-12, atol=0)
    torch.testing.assert_close(wl.grad, 2.0 * (x * c).sum(1, keepdim=True) * (ids >= 0), rtol=1e-12, atol=0)


def test_gather_sum_references_take_zero_tokens_and_zero_rows() -> None:
    # T = 0 (an empty micro-batch): a view with an inferred width of an empty gather used to fail
    assert unpermute_sum_reference(torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int32)).shape == (0, H)
    assert unpermute_weight_grad_reference(torch.zeros(0, H), torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int32)).shape == (0, K)
    # T > 0 with no row at all (every slot dropped): nothing to gather from
    none_TK = torch.full((3, K), -1, dtype=torch.int32)
    assert unpermute_sum_reference(torch.zeros(0, H), none_TK).abs().sum() == 0
    assert unpermute_sum_reference(torch.zeros(0, H), none_TK).shape == (3, H)
    assert unpermute_weight_grad_reference(torch.zeros(3, H), torch.zeros(0, H), none_TK).shape == (3, K)


@pytest.mark.parametrize("counts", [[0, 0, 0, 0], [0, 5, 0, 0], [3, 0, 0, 2], [0, 0, 0, 4]])
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_grouped_gemm_with_zero_row_experts_matches_per_expert_matmul(counts: list[int], backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    R = sum(counts)
    x = torch.randn(R, 16, generator=g)
    w = torch.randn(E, 16, 8, generator=g)
    dy = torch.randn(R, 8, generator=g)
    offs = offsets_from_counts(torch.tensor(counts))
    owner = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    want_y = torch.einsum("rd,rdo->ro", x, w[owner]) if R else x.new_zeros(0, 8)
    want_dw = torch.stack([x[owner == e].t() @ dy[owner == e] for e in range(E)])
    torch.testing.assert_close(gmm(x, w, offs, backend), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gmm_wgrad(x, dy, offs, backend), want_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_weighted_swiglu_on_zero_rows_forward_and_backward(weighted: bool) -> None:
    h = torch.zeros(0, 2 * FF, dtype=torch.float64, requires_grad=True)
    w = torch.zeros(0, dtype=torch.float64, requires_grad=True) if weighted else None
    a = weighted_swiglu(h, w)
    assert a.shape == (0, FF)
    a.sum().backward()
    assert h.grad is not None and h.grad.shape == (0, 2 * FF)
    if weighted:
        assert w.grad is not None and w.grad.shape == (0,)


@pytest.mark.parametrize("aux_loss", ["switch", "seq", "global"])
@pytest.mark.parametrize("memory_efficient_permute", [True, False])
def test_moe_layer_on_an_empty_micro_batch_gives_finite_zero_losses_and_gradients(
    aux_loss: str, memory_efficient_permute: bool
) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, aux_loss=aux_loss, aux_loss_coeff=0.01,
        z_loss_coeff=0.001, shared_expert_ffn_size=FF, memory_efficient_permute=memory_efficient_permute,
    )  # fmt: skip
    layer = MoELayer(cfg)
    x = torch.zeros(0, 5, H, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 5, H)
    y.sum().backward()
    for name, loss in layer.last_aux_losses.items():
        assert torch.isfinite(loss) and float(loss) == 0.0, f"{name} = {float(loss)} on no tokens"
    for name, p in layer.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}: gradient not finite"
