"""Token permutation ops and the LocalDispatcher round trip.

``build_permutation_reference`` on hand-worked cases and against a naive counting loop;
``permute_rows`` / ``unpermute_sum`` against naive loops and ``gradcheck`` in float64;
``LocalDispatcher`` dispatch -> identity experts -> combine reproduces ``sum_k w * x``.

Legend: T tokens, H hidden, E experts, K slots per token, R rows after permutation.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.ops.permute import (
    Permutation,
    build_permutation,
    build_permutation_reference,
    permute_rows,
    permute_rows_reference,
    scatter_rows_reference,
    unpermute_sum,
)

# slots (t*K + k): 0->e2, 1->e0, 2->e0, 3->dropped, 4->e2, 5->e1 ; E = 4 (expert 3 gets nothing)
HAND_IDS = torch.tensor([[2, 0], [0, -1], [2, 1]])


def test_build_permutation_is_stable_sort_by_expert_hand_worked() -> None:
    perm = build_permutation_reference(HAND_IDS, num_experts=4)
    # expert 0: slots 1, 2 (in slot order); expert 1: slot 5; expert 2: slots 0, 4; expert 3: none
    assert perm.slot_of_row_R.tolist() == [1, 2, 5, 0, 4]
    assert perm.slot_row_TK.tolist() == [[3, 0], [1, -1], [4, 2]]
    assert perm.tokens_per_expert_E.tolist() == [2, 1, 2, 0]
    assert perm.src_token_R.tolist() == [0, 1, 2, 0, 2]
    assert perm.num_rows == 5 and perm.top_k == 2


def test_build_permutation_pads_every_expert_to_capacity_hand_worked() -> None:
    perm = build_permutation_reference(HAND_IDS, num_experts=4, capacity=3)
    # expert e owns rows [3e, 3e+3); unused rows are padding (-1)
    assert perm.slot_of_row_R.tolist() == [1, 2, -1, 5, -1, -1, 0, 4, -1, -1, -1, -1]
    assert perm.slot_row_TK.tolist() == [[6, 0], [1, -1], [7, 3]]
    assert perm.tokens_per_expert_E.tolist() == [3, 3, 3, 3]
    assert perm.num_rows == 12


def test_build_permutation_with_all_slots_dropped_has_no_rows() -> None:
    perm = build_permutation_reference(torch.full((3, 2), -1), num_experts=4)
    assert perm.num_rows == 0
    assert perm.slot_row_TK.tolist() == [[-1, -1]] * 3
    assert perm.tokens_per_expert_E.tolist() == [0, 0, 0, 0]


def test_build_permutation_over_capacity_raises() -> None:
    with pytest.raises(ValueError, match=r"capacity=1"):
        build_permutation_reference(HAND_IDS, num_experts=4, capacity=1)


def naive_permutation(ids_TK: torch.Tensor, num_experts: int, capacity: int | None = None):
    """Counting loop: for each expert in order, its slots in increasing slot order."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1).tolist()
    slot_of_row, slot_row = [], [-1] * (T * K)
    for e in range(num_experts):
        slots = [s for s, i in enumerate(flat) if i == e]
        start = len(slot_of_row)
        for j, s in enumerate(slots):
            slot_row[s] = start + j
            slot_of_row.append(s)
        if capacity is not None:
            slot_of_row.extend([-1] * (capacity - len(slots)))
    counts = [capacity if capacity is not None else flat.count(e) for e in range(num_experts)]
    return slot_of_row, torch.tensor(slot_row).view(T, K).tolist(), counts


def _random_ids(seed: int, T: int, K: int, E: int, drop: float = 0.3, empty: tuple[int, ...] = (1,)) -> torch.Tensor:
    """Distinct experts per token, some slots dropped (-1), experts in ``empty`` never chosen."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    return torch.where(torch.rand(T, K, generator=g) < drop, -1, ids)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "padded"])
def test_build_permutation_matches_naive_loop(seed: int, padded: bool) -> None:
    ids = _random_ids(seed, T=9, K=3, E=6, empty=(1, 5))
    capacity = int(torch.bincount(ids[ids >= 0], minlength=6).max()) + 1 if padded else None
    perm = build_permutation_reference(ids, 6, capacity)
    slot_of_row, slot_row, counts = naive_permutation(ids, 6, capacity)
    assert perm.slot_of_row_R.tolist() == slot_of_row
    assert perm.slot_row_TK.tolist() == slot_row
    assert perm.tokens_per_expert_E.tolist() == counts
    public = build_permutation(ids, 6, capacity)  # on CPU: the reference
    assert torch.equal(public.slot_of_row_R, perm.slot_of_row_R) and torch.equal(public.slot_row_TK, perm.slot_row_TK)


# ---- permute_rows / unpermute_sum ------------------------------------------------------------------


def naive_permute(x_TH: torch.Tensor, slot_of_row: list[int], K: int) -> torch.Tensor:
    return torch.stack([x_TH[s // K] if s >= 0 else torch.zeros_like(x_TH[0]) for s in slot_of_row])


def naive_unpermute(y_RH: torch.Tensor, slot_row: list[list[int]], w_TK: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(len(slot_row), y_RH.shape[1], dtype=y_RH.dtype)
    for t, rows in enumerate(slot_row):
        for k, r in enumerate(rows):
            if r >= 0:
                out[t] += (1.0 if w_TK is None else w_TK[t, k]) * y_RH[r]
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "padded"])
def test_permute_rows_matches_naive_gather(seed: int, padded: bool) -> None:
    ids = _random_ids(seed, T=7, K=2, E=5)
    capacity = 6 if padded else None
    perm = build_permutation_reference(ids, 5, capacity)
    slot_of_row, _, _ = naive_permutation(ids, 5, capacity)
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(seed))
    x_R = permute_rows(x, perm)
    kept = perm.slot_of_row_R >= 0
    assert x_R.shape == (len(slot_of_row), 4)
    torch.testing.assert_close(x_R[kept], naive_permute(x, slot_of_row, 2)[kept], atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("drops", [False, True], ids=["dropless", "drops"])
def test_scatter_rows_equals_the_gather_when_every_row_has_one_slot(seed: int, drops: bool) -> None:
    """The csrc scatter's spec: each token's row written to its K rows is the gather, for
    permutations without capacity padding (dropless, or drops: rows are the kept slots)."""
    ids = _random_ids(seed, T=9, K=3, E=5, drop=0.0)
    if drops:
        ids[0, 1] = ids[4, 0] = ids[8, 2] = -1
    perm = build_permutation_reference(ids, 5, None, dropless=not drops)
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(seed))
    scattered = scatter_rows_reference(x, perm.slot_row_TK, perm.num_rows)
    assert scattered.shape == (27 - 3 * drops, 6)
    torch.testing.assert_close(scattered, permute_rows_reference(x, perm.src_token_R), atol=0, rtol=0)


def test_scatter_rows_reference_leaves_rows_without_a_slot_zero() -> None:
    perm = build_permutation_reference(HAND_IDS, 4, capacity=2)  # padded: expert 3's rows have no slot
    x = torch.randn(3, 4)
    out = scatter_rows_reference(x, perm.slot_row_TK, perm.num_rows)
    kept = perm.slot_of_row_R >= 0
    assert bool((~kept).any()) and torch.equal(out[~kept], torch.zeros_like(out[~kept]))
    torch.testing.assert_close(out[kept], permute_rows_reference(x, perm.src_token_R)[kept], atol=0, rtol=0)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "padded"])
def test_unpermute_sum_matches_naive_loop(weighted: bool, padded: bool) -> None:
    ids = _random_ids(3, T=7, K=3, E=5)
    perm = build_permutation_reference(ids, 5, 8 if padded else None)
    _, slot_row, _ = naive_permutation(ids, 5, 8 if padded else None)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(perm.num_rows, 4, generator=g)
    w = torch.rand(7, 3, generator=g) if weighted else None
    torch.testing.assert_close(unpermute_sum(y, perm, w), naive_unpermute(y, slot_row, w), atol=1e-6, rtol=1e-6)


def test_unpermute_sum_keeps_float64() -> None:
    perm = build_permutation_reference(HAND_IDS, 4)
    y = torch.randn(perm.num_rows, 3, dtype=torch.float64)
    w = torch.rand(3, 2, dtype=torch.float64)
    out = unpermute_sum(y, perm, w)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_unpermute(y, perm.slot_row_TK.tolist(), w), atol=1e-14, rtol=0)


@pytest.mark.parametrize("capacity", [None, 3], ids=["dropless", "padded"])
def test_permute_rows_gradcheck_float64(capacity: int | None) -> None:
    perm = build_permutation_reference(HAND_IDS, 4, capacity)
    kept_R1 = (perm.slot_of_row_R >= 0).double().unsqueeze(-1)
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    # Padding rows are don't-care (they read token 0 and carry weight 0): mask them out.
    assert torch.autograd.gradcheck(lambda x: permute_rows(x, perm) * kept_R1, (x,))


@pytest.mark.parametrize("capacity", [None, 3], ids=["dropless", "padded"])
def test_unpermute_sum_gradcheck_float64(capacity: int | None) -> None:
    perm = build_permutation_reference(HAND_IDS, 4, capacity)
    y = torch.randn(perm.num_rows, 2, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w: unpermute_sum(y, perm, w), (y, w))
    assert torch.autograd.gradcheck(lambda y: unpermute_sum(y, perm), (y,))


def test_unpermute_sum_gives_padding_and_dropped_slots_no_gradient() -> None:
    perm = build_permutation_reference(HAND_IDS, 4, capacity=3)
    y = torch.randn(perm.num_rows, 2, requires_grad=True)
    w = torch.rand(3, 2, requires_grad=True)
    unpermute_sum(y, perm, w).sum().backward()
    padding = perm.slot_of_row_R < 0
    assert torch.count_nonzero(y.grad[padding]) == 0
    assert w.grad[1, 1] == 0  # slot (1, 1) was dropped


def test_combine_restores_order_with_empty_experts() -> None:
    # 6 experts, only 1 and 4 receive tokens; rows tagged by their row index come back in token order.
    ids = torch.tensor([[4, 1], [1, 4], [4, 1], [1, 4], [4, 1]])
    perm = build_permutation_reference(ids, 6)
    assert perm.tokens_per_expert_E.tolist() == [0, 5, 0, 0, 5, 0]
    x = torch.arange(5, dtype=torch.float32).unsqueeze(-1) * torch.tensor([[1.0, 10.0]])  # row t = (t, 10t)
    x_R = permute_rows(x, perm)
    # expert-1 rows hold tokens 0..4, then expert-4 rows hold tokens 0..4
    assert x_R[:, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    out = unpermute_sum(x_R, perm, torch.tensor([[0.25, 0.75]] * 5))
    torch.testing.assert_close(out, x, atol=0, rtol=0)


# ---- LocalDispatcher --------------------------------------------------------------------------------


def _dispatch_inputs(seed: int, T: int = 8, K: int = 3, E: int = 6, H: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = _random_ids(seed, T, K, E, drop=0.25, empty=(0, 3))
    w = torch.rand(T, K, generator=g) * (ids >= 0)  # dropped slots have weight 0 (router contract)
    x = torch.randn(T, H, generator=g)
    return x, ids, w


def _expected_weighted_sum(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w * (ids >= 0)).sum(-1, keepdim=True) * x  # identity experts: sum_k w_tk * x_t


@pytest.mark.parametrize("capacity", [None, 8], ids=["dropless", "padded"])
@pytest.mark.parametrize("weight_in_experts", [False, True], ids=["weighted_combine", "weight_in_experts"])
def test_local_dispatcher_round_trip_with_identity_experts(capacity: int | None, weight_in_experts: bool) -> None:
    x, ids, w = _dispatch_inputs(seed=1)
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    dispatcher = LocalDispatcher(6)
    dispatched, handle = dispatcher.dispatch(x, ids, w, capacity)

    counts = torch.bincount(ids[ids >= 0], minlength=6)
    assert dispatched.tokens_per_expert_e.tolist() == ([capacity] * 6 if capacity else counts.tolist())
    assert dispatched.x_RH.shape[0] == (6 * capacity if capacity else int(counts.sum()))
    # each row's weight is its slot's weight; padding rows weigh 0
    perm: Permutation = handle.perm
    slot_R = perm.slot_of_row_R
    expected_w_R = torch.where(slot_R >= 0, w.detach().reshape(-1)[slot_R.clamp(min=0)], 0.0)
    torch.testing.assert_close(dispatched.weights_R.detach(), expected_w_R, atol=0, rtol=0)

    if weight_in_experts:
        y_R = dispatched.x_RH * dispatched.weights_R.unsqueeze(-1)
        out = dispatcher.combine(y_R, handle, weighted=False)
    else:
        out = dispatcher.combine(dispatched.x_RH, handle, weighted=True)
    torch.testing.assert_close(out, _expected_weighted_sum(x.detach(), ids, w.detach()), atol=1e-6, rtol=1e-6)

    g = torch.randn_like(out)
    (out * g).sum().backward()
    # d/dx_t = (sum_k w_tk) g_t ; d/dw_tk = <x_t, g_t> for kept slots, 0 for dropped ones
    torch.testing.assert_close(x.grad, w.detach().sum(-1, keepdim=True) * g, atol=1e-6, rtol=1e-6)
    expected_grad_w = (x.detach() * g).sum(-1, keepdim=True).expand(-1, 3) * (ids >= 0)
    torch.testing.assert_close(w.grad, expected_grad_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(37, 5), (37,), (0, 4)], ids=["rows", "vector", "empty"])
def test_reorder_rows_equals_index_select_forward_and_backward(shape: tuple[int, ...]) -> None:
    """A bijective reorder: same values and same gradient as index_select, gradient by gathering."""
    from lightning_moe.ops.permute import reorder_rows

    g = torch.Generator().manual_seed(sum(shape))
    order = torch.randperm(shape[0], generator=g)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(shape[0])
    x = torch.randn(shape, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = reorder_rows(x, order, inverse)
    ref = x_ref.index_select(0, order)
    assert torch.equal(out, ref)
    up = torch.randn(shape, generator=g)
    out.backward(up)
    ref.backward(up)
    assert torch.equal(x.grad, x_ref.grad)


def test_reorder_rows_rejects_an_order_of_the_wrong_length() -> None:
    from lightning_moe.ops.permute import reorder_rows

    with pytest.raises(ValueError, match="x has 4 rows, order \\(3,\\)"):
        reorder_rows(torch.zeros(4, 2), torch.arange(3), torch.arange(3))


class _RecordingExtension:
    """Stands in for the csrc extension on CPU: records which row kernel the facade picks."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def scatter_rows(self, x: torch.Tensor, slot_row: torch.Tensor, num_rows: int) -> torch.Tensor:
        self.calls.append("scatter")
        return scatter_rows_reference(x, slot_row, num_rows)

    def permute_rows(self, x: torch.Tensor, src: torch.Tensor, scale: None) -> torch.Tensor:
        self.calls.append("gather")
        return permute_rows_reference(x, src)


@pytest.mark.parametrize(
    ("capacity", "rows_of", "expected"),
    [(None, "tokens", "scatter"), (6, "tokens", "gather"), (None, "other", "gather")],
    ids=["dropless", "padded", "rows_not_the_tokens"],
)
def test_expert_rows_scatter_only_where_every_row_has_one_slot(monkeypatch, capacity, rows_of, expected) -> None:  # noqa: ANN001
    """The scatter leaves rows without a slot unwritten: padded permutations (and sources that
    are not the permutation's tokens) must take the gather."""
    import lightning_moe.ops.permute as permute_ops

    ext = _RecordingExtension()
    monkeypatch.setattr(permute_ops, "csrc_extension", lambda t: ext)
    ids = _random_ids(0, T=7, K=2, E=5, drop=0.0)
    perm = build_permutation_reference(ids, 5, capacity, dropless=capacity is None)
    x = torch.randn(7 if rows_of == "tokens" else 9, 4)
    out = permute_ops._expert_rows_impl(x, perm)
    assert ext.calls == [expected] and out.shape == (perm.num_rows, 4)
    if rows_of == "tokens":
        kept = perm.slot_of_row_R >= 0
        torch.testing.assert_close(out[kept], permute_rows_reference(x, perm.src_token_R)[kept], atol=0, rtol=0)


def test_unpermute_sum_of_bf16_rows_with_fp32_weights_rounds_once_from_an_fp32_sum() -> None:
    """bf16 rows, fp32 router weights (the layer's dtypes): products and the K-slot sum run in
    fp32 and only the result is rounded to bf16, so each output is within one bf16 rounding
    (half an ulp, 2**-9 relative) of the exact float64 sum; rtol 2**-8 leaves a factor 2 of margin.
    Rounding the weights or the products to bf16 first lands several ulps off (cancellation)."""
    g = torch.Generator().manual_seed(0)
    T, K, E, H = 16, 4, 8, 32
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    perm = build_permutation_reference(ids, E, dropless=True)
    y = torch.randn(perm.num_rows, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    out = unpermute_sum(y, perm, w)
    assert out.dtype == torch.bfloat16
    rows_TK = perm.slot_row_TK.long()
    exact = (y.double()[rows_TK] * w.double().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=2**-8)
