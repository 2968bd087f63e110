"""Grouped SwiGLU experts: ``expert_swiglu_mlp`` (torch grouped_mm and loop backends) and
``GroupedExperts`` against a plain per-expert autograd reference written here.

Legend: R rows grouped by expert, H hidden, F expert FFN width, E experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.expert_mlp import expert_swiglu_mlp, expert_swiglu_mlp_reference
from lightning_moe.ops.grouped_gemm import offsets_from_counts

# fp32, O(1) values: a few ulps of accumulated rounding over H=8 / F=12 dot products.
ATOL = 1e-5
RTOL = 1e-5
H, FF = 8, 12  # multiples of 4: F.grouped_mm needs 16-byte aligned rows in fp32

# Rows per expert; every case has at least one expert with no rows, in various positions.
COUNTS_CASES = {
    "empty_middle": [3, 0, 5, 0, 2],
    "empty_ends": [0, 4, 1, 6, 0],
    "one_busy_expert": [0, 0, 7, 0],
    "single_rows": [1, 0, 1, 1, 0, 1],
}


def _random_counts(seed: int, num_experts: int = 6) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (num_experts,), generator=g)
    counts[torch.randperm(num_experts, generator=g)[:2]] = 0  # at least two empty experts
    if counts.sum() == 0:
        counts[-1] = 3
    return counts.tolist()


for _seed in range(3):
    COUNTS_CASES[f"random_{_seed}"] = _random_counts(_seed)


def per_expert_swiglu(
    x_RH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int], w_R: torch.Tensor | None
) -> torch.Tensor:
    """Independent spec: for each expert, ``(silu(x Wg) * (x Wu) * w) @ Wd`` on its own rows."""
    ffn = w2.shape[1]
    out, start = [], 0
    for e, count in enumerate(counts):
        x_e = x_RH[start : start + count]
        h = x_e @ w13[e]
        a = F.silu(h[:, :ffn]) * h[:, ffn:]
        if w_R is not None:
            a = a * w_R[start : start + count].unsqueeze(-1)
        out.append(a @ w2[e])
        start += count
    return torch.cat(out)


def _inputs(counts: list[int], seed: int, weighted: bool):
    g = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    x = torch.randn(R, H, generator=g)
    w13 = torch.randn(E, H, 2 * FF, generator=g) * 0.4
    w2 = torch.randn(E, FF, H, generator=g) * 0.4
    w_R = torch.rand(R, generator=g) + 0.1 if weighted else None
    grad_y = torch.randn(R, H, generator=g)
    return x, w13, w2, w_R, grad_y


def _leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_(True) for t in tensors]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("weighted", [True, False], ids=["row_weights", "no_row_weights"])
@pytest.mark.parametrize("counts_name", sorted(COUNTS_CASES))
@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_expert_mlp_forward_and_all_grads_match_per_expert_reference(
    backend: str, counts_name: str, weighted: bool
) -> None:
    counts = COUNTS_CASES[counts_name]
    x, w13, w2, w_R, grad_y = _inputs(counts, seed=len(counts_name), weighted=weighted)
    offs = offsets_from_counts(torch.tensor(counts))

    xa, w13a, w2a, wa = _leaves(x, w13, w2, w_R)
    y = expert_swiglu_mlp(xa, w13a, w2a, offs, wa, backend)
    y.backward(grad_y)

    xr, w13r, w2r, wr = _leaves(x, w13, w2, w_R)
    y_ref = per_expert_swiglu(xr, w13r, w2r, counts, wr)
    y_ref.backward(grad_y)

    _assert_close(y, y_ref, "y")
    _assert_close(xa.grad, xr.grad, "grad x")
    _assert_close(w13a.grad, w13r.grad, "grad w13")
    _assert_close(w2a.grad, w2r.grad, "grad w2")
    if weighted:
        _assert_close(wa.grad, wr.grad, "grad w_R")
    # Experts that got no rows must get an exact zero gradient (not stale memory).
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(w13a.grad[e]) == 0 and torch.count_nonzero(w2a.grad[e]) == 0


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_expert_mlp_backends_agree_with_each_other(backend: str) -> None:
    counts = COUNTS_CASES["random_1"]
    x, w13, w2, w_R, grad_y = _inputs(counts, seed=7, weighted=True)
    offs = offsets_from_counts(torch.tensor(counts))
    y = expert_swiglu_mlp(x, w13, w2, offs, w_R, backend)
    y_other = expert_swiglu_mlp(x, w13, w2, offs, w_R, "loop" if backend == "torch" else "torch")
    _assert_close(y, y_other, "y")


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_expert_mlp_handles_zero_rows(backend: str) -> None:
    E = 3
    x = torch.randn(0, H, requires_grad=True)
    w13 = torch.randn(E, H, 2 * FF, requires_grad=True)
    w2 = torch.randn(E, FF, H, requires_grad=True)
    w_R = torch.rand(0, requires_grad=True)
    y = expert_swiglu_mlp(x, w13, w2, torch.zeros(E, dtype=torch.int32), w_R, backend)
    y.sum().backward()
    assert y.shape == (0, H)
    assert torch.equal(w13.grad, torch.zeros_like(w13)) and torch.equal(w2.grad, torch.zeros_like(w2))
    assert x.grad.shape == (0, H) and w_R.grad.shape == (0,)


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_expert_mlp_with_frozen_expert_weights_still_gives_input_and_row_weight_grads(backend: str) -> None:
    counts = COUNTS_CASES["random_2"]
    x, w13, w2, w_R, grad_y = _inputs(counts, seed=13, weighted=True)
    offs = offsets_from_counts(torch.tensor(counts))
    xa, wa = _leaves(x, w_R)  # w13 and w2 frozen: no grad wanted
    expert_swiglu_mlp(xa, w13, w2, offs, wa, backend).backward(grad_y)
    xr, wr = _leaves(x, w_R)
    per_expert_swiglu(xr, w13, w2, counts, wr).backward(grad_y)
    assert xa.grad is not None and wa.grad is not None
    _assert_close(xa.grad, xr.grad, "grad x")
    _assert_close(wa.grad, wr.grad, "grad w_R")


def test_library_reference_matches_independent_reference() -> None:
    counts = COUNTS_CASES["empty_ends"]
    x, w13, w2, w_R, _ = _inputs(counts, seed=3, weighted=True)
    _assert_close(
        expert_swiglu_mlp_reference(x, w13, w2, torch.tensor(counts), w_R),
        per_expert_swiglu(x, w13, w2, counts, w_R),
        "reference",
    )


def test_library_reference_gives_zero_rows_past_the_last_expert() -> None:
    counts = COUNTS_CASES["empty_middle"]  # 10 routed rows
    x, w13, w2, w_R, _ = _inputs(counts, seed=5, weighted=True)
    x_padded = torch.cat([x, torch.randn(3, H)])  # 3 padding rows past offs[-1]
    w_R_padded = torch.cat([w_R, torch.ones(3)])
    y = expert_swiglu_mlp_reference(x_padded, w13, w2, torch.tensor(counts), w_R_padded)
    assert y.shape == (sum(counts) + 3, H)
    _assert_close(y[: sum(counts)], per_expert_swiglu(x, w13, w2, counts, w_R), "routed rows")
    assert torch.count_nonzero(y[sum(counts) :]) == 0


# ---- GroupedExperts module -----------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [True, False], ids=["row_weights", "no_row_weights"])
@pytest.mark.parametrize("backend", ["auto", "torch", "loop"])
def test_grouped_experts_module_matches_reference_with_empty_experts(backend: str, weighted: bool) -> None:
    counts = COUNTS_CASES["empty_middle"]
    x, w13, w2, w_R, grad_y = _inputs(counts, seed=11, weighted=weighted)
    experts = GroupedExperts(len(counts), H, FF, backend=backend)
    with torch.no_grad():
        experts.w13.copy_(w13)
        experts.w2.copy_(w2)
    assert experts.w13.shape == (len(counts), H, 2 * FF) and experts.w2.shape == (len(counts), FF, H)

    xa, wa = _leaves(x, w_R)
    y = experts(xa, torch.tensor(counts), wa)
    y.backward(grad_y)

    xr, w13r, w2r, wr = _leaves(x, w13, w2, w_R)
    y_ref = per_expert_swiglu(xr, w13r, w2r, counts, wr)
    y_ref.backward(grad_y)

    _assert_close(y, y_ref, "y")
    _assert_close(xa.grad, xr.grad, "grad x")
    _assert_close(experts.w13.grad, w13r.grad, "grad w13")
    _assert_close(experts.w2.grad, w2r.grad, "grad w2")
    if weighted:
        _assert_close(wa.grad, wr.grad, "grad w_R")


def test_grouped_experts_auto_resolves_to_grouped_mm_for_aligned_fp32() -> None:
    experts = GroupedExperts(4, H, FF, backend="auto")
    assert experts.gemm_backend(torch.device("cpu"), torch.float32) == "torch"


def test_grouped_experts_auto_falls_back_to_loop_for_odd_widths_with_one_warning() -> None:
    counts = [2, 0, 3]
    experts = GroupedExperts(3, 6, 5, backend="auto")  # 6 and 5 are not multiples of 4
    x = torch.randn(5, 6)
    with pytest.warns(UserWarning, match=r"per-expert loop.*\[6, 10, 5\]"):
        y = experts(x, torch.tensor(counts))
    assert experts.gemm_backend(x.device, x.dtype) == "loop"
    _assert_close(y, per_expert_swiglu(x, experts.w13.detach(), experts.w2.detach(), counts, None), "y")


def test_grouped_experts_torch_backend_rejects_odd_widths() -> None:
    experts = GroupedExperts(2, 6, 5, backend="torch")
    with pytest.raises(ValueError, match=r"experts_backend='torch' cannot run.*\[6, 10, 5\]"):
        experts(torch.randn(3, 6), torch.tensor([1, 2]))
