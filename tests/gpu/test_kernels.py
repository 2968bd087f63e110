"""Every csrc kernel against a plain-torch reference, on random shapes, on the GPU.

Legend: T tokens, H hidden, F expert FFN width, E experts, K top-k, N = T*K slots, R rows.

The ops return freshly allocated outputs. To catch elements a kernel never writes, each call
runs right after the exact same output allocations were made, filled with poison (NaN for
floats, 0x7F7F7F7F for int32) and freed: the caching allocator hands those blocks back in the
same order, which :func:`_call_poisoned` checks by pointer. A NaN or a poison integer in an
output is then an unwritten element.

Tolerances (relative to the reference, with an absolute floor of tol * max|reference|):
fp32 1e-5, fp16 2e-3 (one fp16 ulp is up to 9.8e-4), bf16 1e-2. Integer outputs must match exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe.ops.build import load_extension  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POISON_INT = 0x7F7F7F7F  # no valid row index, count or expert id


@pytest.fixture(scope="module")
def ops():
    # mode="csrc": a failed build raises with the compiler's first error instead of skipping.
    return load_extension(mode="csrc")


# ---- helpers -------------------------------------------------------------------------------------


def _call_poisoned(fn: Callable[[], object], out_specs: Sequence[tuple[Sequence[int], torch.dtype]]):
    """Run ``fn`` so that its outputs (``out_specs``: shape, dtype, in allocation order) land
    on memory that was just filled with poison."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poisons = []
    for shape, dtype in out_specs:
        p = torch.empty(tuple(shape), dtype=dtype, device=DEV)
        p.fill_(float("nan") if dtype.is_floating_point else POISON_INT)
        poisons.append(p)
    ptrs = [p.data_ptr() for p in poisons if p.numel() > 0]
    del p
    poisons.clear()
    result = fn()
    outs = result if isinstance(result, (tuple, list)) else (result,)
    got = [o.data_ptr() for o in outs if o is not None and o.numel() > 0]
    assert got == ptrs, (
        "the caching allocator did not return the poisoned blocks (pointers "
        f"{got} != {ptrs}); unwritten outputs would go unnoticed"
    )
    return result


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.float(), expected.float()
    nan = torch.isnan(a) & ~torch.isnan(e)
    assert not bool(nan.any()), f"{what}: {int(nan.sum())} elements never written (NaN poison), first at {nan.nonzero()[0].tolist()}"
    scale = float(e.abs().max()) if e.numel() else 0.0
    torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


def _random_topk_ids(T: int, K: int, E: int, *, gen: torch.Generator, used_experts: int | None = None,
                     drop_frac: float = 0.0, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Distinct experts per token (like a router), drawn from the first ``used_experts`` (so the
    rest get zero tokens); a fraction of slots dropped (-1)."""
    used = E if used_experts is None else used_experts
    assert K <= used
    ids_TK = torch.rand(T, used, generator=gen).argsort(dim=1)[:, :K]
    if drop_frac > 0:
        ids_TK[torch.rand(T, K, generator=gen) < drop_frac] = -1
    return ids_TK.to(dtype)


# ---- references (the spec, in plain torch) ---------------------------------------------------------


def build_permutation_reference(ids_TK: torch.Tensor, E: int):
    T, K = ids_TK.shape
    flat_N = ids_TK.reshape(-1).long().cpu()
    kept_N = (flat_N >= 0) & (flat_N < E)
    key_N = torch.where(kept_N, flat_N, torch.full_like(flat_N, E))
    order_N = torch.argsort(key_N, stable=True)
    n_kept = int(kept_N.sum())
    src_idx_N = torch.full((T * K,), -1, dtype=torch.long)
    src_idx_N[:n_kept] = order_N[:n_kept] // K
    slot_row_N = torch.full((T * K,), -1, dtype=torch.long)
    slot_row_N[order_N[:n_kept]] = torch.arange(n_kept)
    counts_E = torch.bincount(flat_N[kept_N], minlength=E)
    return src_idx_N.int(), slot_row_N.view(T, K).int(), counts_E.int(), counts_E.cumsum(0).int()


def permute_rows_reference(x_SH: torch.Tensor, src_R: torch.Tensor, scale_R: torch.Tensor | None) -> torch.Tensor:
    valid_R = src_R >= 0
    out_RH = torch.zeros(src_R.shape[0], x_SH.shape[1], dtype=torch.float32, device=x_SH.device)
    out_RH[valid_R] = x_SH[src_R[valid_R].long()].float()
    if scale_R is not None:
        out_RH = out_RH * scale_R.unsqueeze(-1)
    return out_RH.to(x_SH.dtype)


def unpermute_sum_reference(y_RH: torch.Tensor, slot_row_TK: torch.Tensor, w_TK: torch.Tensor | None) -> torch.Tensor:
    T, K = slot_row_TK.shape
    kept_TK = slot_row_TK >= 0
    rows_TKH = y_RH.float()[slot_row_TK.clamp(min=0).long()] if y_RH.shape[0] else torch.zeros(T, K, y_RH.shape[1], device=y_RH.device)
    scale_TK = kept_TK.float() if w_TK is None else w_TK * kept_TK
    return (rows_TKH * scale_TK.unsqueeze(-1)).sum(1).to(y_RH.dtype)


def unpermute_weight_grad_reference(g_TH: torch.Tensor, y_RH: torch.Tensor, slot_row_TK: torch.Tensor) -> torch.Tensor:
    T, K = slot_row_TK.shape
    kept_TK = slot_row_TK >= 0
    if y_RH.shape[0] == 0:
        return torch.zeros(T, K, device=g_TH.device)
    rows_TKH = y_RH.float()[slot_row_TK.clamp(min=0).long()]
    return (rows_TKH * g_TH.float().unsqueeze(1)).sum(-1) * kept_TK


def weighted_swiglu_reference(h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> torch.Tensor:
    gate_RF, up_RF = h_R2F.float().chunk(2, dim=-1)
    a_RF = F.silu(gate_RF) * up_RF
    if w_R is not None:
        a_RF = a_RF * w_R.unsqueeze(-1)
    return a_RF.to(h_R2F.dtype)


def weighted_swiglu_backward_reference(h_R2F, w_R, grad_a_RF):
    """Autograd through the fp32 forward: (grad_h in h's dtype, grad_w fp32 as if w existed)."""
    h32 = h_R2F.float().requires_grad_(True)
    w32 = (w_R if w_R is not None else torch.ones(h_R2F.shape[0], device=h_R2F.device)).clone().requires_grad_(True)
    gate_RF, up_RF = h32.chunk(2, dim=-1)
    a_RF = F.silu(gate_RF) * up_RF * w32.unsqueeze(-1)
    a_RF.backward(grad_a_RF.float())
    return h32.grad.to(h_R2F.dtype), w32.grad


def router_selection_scores_reference(logits_TE, bias_E, score_func, pre_softmax):
    if score_func == "sigmoid":
        scores_TE = logits_TE.sigmoid()
    elif pre_softmax:
        scores_TE = logits_TE.softmax(-1)
    else:
        scores_TE = logits_TE
    sel_TE = scores_TE if bias_E is None else scores_TE + bias_E
    return scores_TE, sel_TE


def router_topk_reference(logits_TE, bias_E, K, score_func, pre_softmax, norm_topk_prob, scaling_factor,
                          num_groups, group_topk):
    """(ids, weights, margin): margin is the smallest gap at a selection boundary per token (top-K
    boundary, and the group boundary when grouped): rows with a tiny margin may flip on rounding."""
    T, E = logits_TE.shape
    scores_TE, sel_TE = router_selection_scores_reference(logits_TE, bias_E, score_func, pre_softmax)
    margin_T = torch.full((T,), math.inf)
    if num_groups > 0:
        gs_TG = sel_TE.view(T, num_groups, -1).topk(K // group_topk, dim=-1).values.sum(-1)
        if group_topk < num_groups:
            top_TG = gs_TG.topk(group_topk + 1, dim=-1).values
            margin_T = torch.minimum(margin_T, top_TG[:, -2] - top_TG[:, -1])
        keep_TG = torch.zeros_like(gs_TG, dtype=torch.bool).scatter_(1, gs_TG.topk(group_topk, dim=-1).indices, True)
        sel_TE = sel_TE.masked_fill(~keep_TG.repeat_interleave(E // num_groups, dim=1), -math.inf)
    top_TK1 = sel_TE.topk(min(K + 1, E), dim=-1)
    ids_TK = top_TK1.indices[:, :K]
    if K < E:
        gap_T = top_TK1.values[:, K - 1] - top_TK1.values[:, K]
        margin_T = torch.minimum(margin_T, torch.nan_to_num(gap_T, posinf=math.inf))
    return ids_TK, router_weights_reference(scores_TE, ids_TK, K, score_func, pre_softmax, norm_topk_prob, scaling_factor), margin_T


def router_weights_reference(scores_TE, ids_TK, K, score_func, pre_softmax, norm_topk_prob, scaling_factor):
    picked_TK = scores_TE.gather(1, ids_TK)
    if score_func == "softmax" and not pre_softmax:
        w_TK = picked_TK.softmax(-1)
    else:
        w_TK = picked_TK
        if norm_topk_prob and (score_func == "softmax" or K > 1):
            w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    return w_TK * scaling_factor


# ---- build_permutation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("T", "K", "E", "used", "drop"),
    [
        (1, 1, 1, None, 0.0),
        (7, 2, 8, 3, 0.0),  # five experts get no tokens
        (129, 8, 128, None, 0.0),
        (129, 8, 128, 40, 0.2),  # empty experts and dropped slots
        (4096, 8, 128, None, 0.0),  # many chunks
        (333, 6, 1000, 900, 0.1),
        (50, 4, 8192, None, 0.05),  # largest E: one warp per block
        (0, 4, 16, None, 0.0),  # no tokens
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_build_permutation_matches_stable_argsort(ops, T, K, E, used, drop, id_dtype) -> None:
    gen = torch.Generator().manual_seed(T * 1000 + E)
    ids_TK = _random_topk_ids(T, K, E, gen=gen, used_experts=used, drop_frac=drop, dtype=id_dtype).to(DEV)
    i32 = torch.int32
    out = _call_poisoned(lambda: ops.build_permutation(ids_TK, E), [((T * K,), i32), ((T, K), i32), ((E,), i32), ((E,), i32)])
    for name, got, want in zip(("src_idx", "slot_row", "counts", "offsets"), out, build_permutation_reference(ids_TK, E)):
        assert got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), want), f"{name} differs (T={T}, K={K}, E={E})"


def test_build_permutation_treats_out_of_range_ids_as_dropped(ops) -> None:
    ids_TK = torch.tensor([[0, 5], [-1, 2], [7, 1]], dtype=torch.int32, device=DEV)  # E=4: 5, 7 out of range
    src_idx, slot_row, counts, offsets = ops.build_permutation(ids_TK, 4)
    # kept slots in order: (0,0)->e0, (2,1)->e1, (1,1)->e2
    assert slot_row.cpu().tolist() == [[0, -1], [-1, 2], [-1, 1]]
    assert src_idx.cpu().tolist() == [0, 2, 1, -1, -1, -1]
    assert counts.cpu().tolist() == [1, 1, 1, 0]
    assert offsets.cpu().tolist() == [1, 2, 3, 3]


def test_build_permutation_is_deterministic(ops) -> None:
    gen = torch.Generator().manual_seed(0)
    ids_TK = _random_topk_ids(8192, 8, 64, gen=gen, drop_frac=0.01).to(DEV)
    first = ops.build_permutation(ids_TK, 64)
    for _ in range(3):
        again = ops.build_permutation(ids_TK, 64)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---- permute_rows / unpermute_sum / unpermute_weight_grad ----------------------------------------

# H: 16-byte vectors for every dtype (64, 2048), 8-byte (4 in fp16/bf16), 4-byte (2), scalar (odd).
SHAPES_THKE = [(1, 64, 1, 1), (37, 2048, 2, 8), (129, 100, 8, 16), (64, 127, 4, 8), (5, 2, 3, 4), (200, 68, 8, 128)]


def _routing(T, K, E, seed, drop=0.1):
    gen = torch.Generator().manual_seed(seed)
    # Half the experts unused: experts with zero tokens.
    ids_TK = _random_topk_ids(T, K, E, gen=gen, used_experts=max(K, E // 2), drop_frac=drop)
    src_idx, slot_row, counts, _ = build_permutation_reference(ids_TK, E)
    return src_idx.to(DEV), slot_row.to(DEV), gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H", "K", "E"), SHAPES_THKE)
@pytest.mark.parametrize("scaled", [False, True])
def test_permute_rows_gathers_rows_and_zeroes_padding(ops, T, H, K, E, dtype, scaled) -> None:
    src_idx_R, _, gen = _routing(T, K, E, seed=T + H)
    x_SH = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    scale_R = torch.rand(src_idx_R.shape[0], generator=gen).to(DEV) if scaled else None
    out_RH = _call_poisoned(lambda: ops.permute_rows(x_SH, src_idx_R, scale_R), [((src_idx_R.shape[0], H), dtype)])
    expected = permute_rows_reference(x_SH, src_idx_R, scale_R)
    if scaled:
        _assert_close(out_RH, expected, TOL[dtype], "permute_rows(scaled)")
    else:
        assert torch.equal(out_RH, expected), "permute_rows must copy rows bit for bit"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H", "K", "E"), SHAPES_THKE)
@pytest.mark.parametrize("drop", [0.0, 0.1], ids=["dropless", "drops"])
def test_scatter_rows_writes_every_row_like_the_gather(ops, T, H, K, E, dtype, drop) -> None:
    """Dropless: every row has one slot, so every row is written (poisoned memory catches a miss)
    and equals the gather bit for bit. With drops the -1 tail rows have no slot; the rest match."""
    src_idx_R, slot_row_TK, gen = _routing(T, K, E, seed=5 * T + H, drop=drop)
    x_TH = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    R = src_idx_R.shape[0]
    out_RH = _call_poisoned(lambda: ops.scatter_rows(x_TH, slot_row_TK, R), [((R, H), dtype)])
    expected = permute_rows_reference(x_TH, src_idx_R, None)
    kept = src_idx_R >= 0
    assert bool(kept.all()) or drop > 0
    assert torch.equal(out_RH[kept], expected[kept]), "scatter_rows must copy rows bit for bit"


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows_handles_misaligned_storage(ops, dtype) -> None:
    T, K, H = 33, 2, 64
    base = torch.randn(T * H + 1, device=DEV).to(dtype)
    x_TH = base[1:].view(T, H)
    assert x_TH.data_ptr() % 16 != 0
    slot_row_TK = torch.randperm(T * K, device=DEV).int().view(T, K)
    src_R = torch.empty(T * K, dtype=torch.long, device=DEV)
    src_R[slot_row_TK.flatten().long()] = torch.arange(T, device=DEV).repeat_interleave(K)
    assert torch.equal(ops.scatter_rows(x_TH, slot_row_TK, T * K), x_TH[src_R])


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_rows_handles_misaligned_storage(ops, dtype) -> None:
    # A contiguous view starting one element into its storage is not 16-byte aligned: the
    # launcher must fall back to narrower accesses.
    T, H = 33, 64
    base = torch.randn(T * H + 1, device=DEV).to(dtype)
    x_SH = base[1:].view(T, H)
    assert x_SH.data_ptr() % 16 != 0
    src_R = torch.randperm(T, device=DEV).int()
    assert torch.equal(ops.permute_rows(x_SH, src_R, None), x_SH[src_R.long()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H", "K", "E"), SHAPES_THKE)
@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_sum_restores_token_order_with_empty_experts(ops, T, H, K, E, dtype, weighted) -> None:
    src_idx_R, slot_row_TK, gen = _routing(T, K, E, seed=3 * T + H)
    # dropped slots leave -1 tail rows in src_idx; y has a row for every slot anyway
    y_RH = torch.randn(src_idx_R.shape[0], H, generator=gen).to(dtype).to(DEV)
    w_TK = torch.rand(T, K, generator=gen).to(DEV) if weighted else None
    out_TH = _call_poisoned(lambda: ops.unpermute_sum(y_RH, slot_row_TK, w_TK), [((T, H), dtype)])
    _assert_close(out_TH, unpermute_sum_reference(y_RH, slot_row_TK, w_TK), TOL[dtype], "unpermute_sum")


def test_unpermute_sum_gives_zero_rows_for_fully_dropped_tokens(ops) -> None:
    y_RH = torch.randn(2, 16, device=DEV)
    slot_row_TK = torch.tensor([[-1, -1], [1, 0], [-1, -1]], dtype=torch.int32, device=DEV)
    out_TH = ops.unpermute_sum(y_RH, slot_row_TK, None)
    assert torch.equal(out_TH[0], torch.zeros(16, device=DEV)) and torch.equal(out_TH[2], torch.zeros(16, device=DEV))
    torch.testing.assert_close(out_TH[1], y_RH[0] + y_RH[1])


def test_unpermute_sum_is_deterministic(ops) -> None:
    src_idx_R, slot_row_TK, gen = _routing(4096, 8, 64, seed=1, drop=0.0)
    y_RH = torch.randn(src_idx_R.shape[0], 256, generator=gen).to(torch.bfloat16).to(DEV)
    w_TK = torch.rand(4096, 8, generator=gen).to(DEV)
    first = ops.unpermute_sum(y_RH, slot_row_TK, w_TK)
    assert all(torch.equal(first, ops.unpermute_sum(y_RH, slot_row_TK, w_TK)) for _ in range(3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H", "K", "E"), SHAPES_THKE)
def test_unpermute_weight_grad_is_rowwise_dot(ops, T, H, K, E, dtype) -> None:
    src_idx_R, slot_row_TK, gen = _routing(T, K, E, seed=5 * T + H)
    y_RH = torch.randn(src_idx_R.shape[0], H, generator=gen).to(dtype).to(DEV)
    g_TH = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    grad_w_TK = _call_poisoned(lambda: ops.unpermute_weight_grad(g_TH, y_RH, slot_row_TK), [((T, K), torch.float32)])
    assert grad_w_TK.dtype == torch.float32
    # inputs are the same on both sides and the math is fp32: only summation order differs
    _assert_close(grad_w_TK, unpermute_weight_grad_reference(g_TH, y_RH, slot_row_TK), 1e-5, "unpermute_weight_grad")


# ---- weighted SwiGLU -----------------------------------------------------------------------------

# F: 768 (qwen3), 2048 (one 256-thread row), 100 (8-byte vectors in bf16), 33 (odd: scalar), 8.
SHAPES_RF = [(1, 8), (37, 768), (256, 100), (19, 33), (64, 2048), (0, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("R", "F_"), SHAPES_RF)
@pytest.mark.parametrize("weighted", [False, True])
def test_weighted_swiglu_forward_matches_reference(ops, R, F_, dtype, weighted) -> None:
    gen = torch.Generator().manual_seed(R * 7 + F_)
    h_R2F = (2 * torch.randn(R, 2 * F_, generator=gen)).to(dtype).to(DEV)
    w_R = torch.rand(R, generator=gen).to(DEV) if weighted else None
    a_RF = _call_poisoned(lambda: ops.weighted_swiglu_fwd(h_R2F, w_R), [((R, F_), dtype)])
    _assert_close(a_RF, weighted_swiglu_reference(h_R2F, w_R), TOL[dtype], "weighted_swiglu_fwd")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("R", "F_"), SHAPES_RF)
@pytest.mark.parametrize(("weighted", "need_grad_w"), [(False, False), (True, False), (True, True), (False, True)])
def test_weighted_swiglu_backward_matches_autograd(ops, R, F_, dtype, weighted, need_grad_w) -> None:
    gen = torch.Generator().manual_seed(R * 11 + F_)
    h_R2F = (2 * torch.randn(R, 2 * F_, generator=gen)).to(dtype).to(DEV)
    w_R = torch.rand(R, generator=gen).to(DEV) if weighted else None
    grad_a_RF = torch.randn(R, F_, generator=gen).to(dtype).to(DEV)
    specs = [((R, 2 * F_), dtype)] + ([((R,), torch.float32)] if need_grad_w else [])
    grad_h, grad_w = _call_poisoned(lambda: ops.weighted_swiglu_bwd(h_R2F, w_R, grad_a_RF, need_grad_w), specs)
    ref_h, ref_w = weighted_swiglu_backward_reference(h_R2F, w_R, grad_a_RF)
    _assert_close(grad_h, ref_h, TOL[dtype], "weighted_swiglu_bwd grad_h")
    if need_grad_w:
        assert grad_w is not None and grad_w.dtype == torch.float32
        _assert_close(grad_w, ref_w, max(TOL[dtype], 1e-5), "weighted_swiglu_bwd grad_w")
    else:
        assert grad_w is None


def test_weighted_swiglu_grad_w_is_deterministic(ops) -> None:
    gen = torch.Generator().manual_seed(2)
    h_R2F = torch.randn(512, 1536, generator=gen).to(torch.bfloat16).to(DEV)
    w_R = torch.rand(512, generator=gen).to(DEV)
    g_RF = torch.randn(512, 768, generator=gen).to(torch.bfloat16).to(DEV)
    first = ops.weighted_swiglu_bwd(h_R2F, w_R, g_RF, True)
    for _ in range(3):
        again = ops.weighted_swiglu_bwd(h_R2F, w_R, g_RF, True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ---- router_topk ---------------------------------------------------------------------------------

ROUTERS = {
    # name: (E, K, score_func, pre_softmax, norm_topk_prob, scaling_factor, num_groups, group_topk, bias)
    "qwen3": (128, 8, "softmax", False, True, 1.0, 0, 0, False),
    "mixtral_pre_softmax": (8, 2, "softmax", True, True, 1.0, 0, 0, False),
    "pre_softmax_k1_no_norm": (64, 1, "softmax", True, False, 1.0, 0, 0, False),
    "pre_softmax_k1_norm": (64, 1, "softmax", True, True, 1.0, 0, 0, False),
    "softmax_bias_E1000_k32": (1000, 32, "softmax", False, False, 1.0, 0, 0, True),
    "deepseek_v3": (256, 8, "sigmoid", False, True, 2.5, 8, 4, True),
    "sigmoid_k1": (64, 1, "sigmoid", False, True, 1.0, 0, 0, True),
    "sigmoid_no_norm": (96, 6, "sigmoid", False, False, 1.5, 0, 0, False),
    "odd_E33_groups": (33, 3, "softmax", False, True, 1.0, 3, 3, True),
    "E7_k2": (7, 2, "softmax", True, True, 1.0, 0, 0, False),
    "groups_32": (512, 8, "sigmoid", False, True, 1.0, 32, 4, True),
}


def _distinct_logits(T: int, E: int, gen: torch.Generator) -> torch.Tensor:
    # Per-token permutations on a grid: distinct values with gaps far above fp32 rounding.
    return (torch.rand(T, E, generator=gen).argsort(dim=1).float() / E - 0.5) * 8


@pytest.mark.parametrize("T", [1, 257])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_topk_matches_reference(ops, name, T) -> None:
    E, K, score_func, pre, norm, scaling, G, gk, with_bias = ROUTERS[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + T)
    logits_TE = _distinct_logits(T, E, gen)
    bias_E = (torch.rand(E, generator=gen).argsort().float() / E - 0.5) * 0.37 if with_bias else None
    ids_ref, w_ref, margin_T = router_topk_reference(logits_TE, bias_E, K, score_func, pre, norm, scaling, G, gk)
    args = (logits_TE.to(DEV), None if bias_E is None else bias_E.to(DEV), K, score_func, pre, norm, scaling, G, gk)
    ids_TK, w_TK = _call_poisoned(lambda: ops.router_topk(*args), [((T, K), torch.int64), ((T, K), torch.float32)])
    assert ids_TK.dtype == torch.int64, "the kernel writes the router's id dtype (int64)"
    ids_TK, w_TK = ids_TK.cpu(), w_TK.cpu()
    assert bool(((ids_TK >= 0) & (ids_TK < E)).all()), "ids out of range (unwritten?)"
    assert all(len(set(row)) == K for row in ids_TK.tolist()), "an expert was chosen twice for one token"
    # Rows whose selection boundary is far from a tie must match exactly; all rows are checked
    # for weights against the reference weights of the kernel's own choice.
    clear_T = margin_T > 1e-4
    assert float(clear_T.float().mean()) > 0.9, "test data too close to ties to be meaningful"
    assert torch.equal(ids_TK[clear_T], ids_ref[clear_T]), f"{name}: top-k ids differ"
    scores_TE, _ = router_selection_scores_reference(logits_TE, bias_E, score_func, pre)
    w_expected = router_weights_reference(scores_TE, ids_TK, K, score_func, pre, norm, scaling)
    _assert_close(w_TK, w_expected, 1e-5, f"{name}: topk_weights")


def test_router_topk_breaks_ties_towards_lower_expert(ops) -> None:
    ids_TK, w_TK = ops.router_topk(torch.zeros(3, 64, device=DEV), None, 4, "softmax", False, True, 1.0, 0, 0)
    assert ids_TK.cpu().tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(w_TK.cpu(), torch.full((3, 4), 0.25))


def test_router_topk_bias_steers_selection_but_not_weights(ops) -> None:
    logits_TE = torch.tensor([[3.0, 2.0, 1.0, 0.0]], device=DEV)
    bias_E = torch.tensor([0.0, 0.0, 0.0, 10.0], device=DEV)
    ids_TK, w_TK = ops.router_topk(logits_TE, bias_E, 2, "sigmoid", False, False, 1.0, 0, 0)
    assert ids_TK.cpu().tolist() == [[3, 0]]  # expert 3 selected by bias, first
    torch.testing.assert_close(w_TK.cpu(), torch.sigmoid(torch.tensor([[0.0, 3.0]])))


# ---- argument checks -----------------------------------------------------------------------------


# One case per test: a crash in one error path (seen once on the H200: a segfault somewhere in
# this group, after every kernel comparison had passed) then names its case in `pytest -v`.
_BAD_CALLS = {
    "index_dtype": (r"src_idx\.dtype=Long must be Int",
                    lambda ops, x: ops.permute_rows(x, torch.zeros(2, dtype=torch.long, device=DEV), None)),
    "x_on_cpu_idx_on_gpu": (r"x is on cpu",
                            lambda ops, x: ops.permute_rows(x.cpu(), torch.zeros(2, dtype=torch.int32, device=DEV), None)),
    "all_on_cpu": (r"x is on cpu",
                   lambda ops, x: ops.permute_rows(x.cpu(), torch.zeros(2, dtype=torch.int32), None)),
    "not_contiguous": (r"not contiguous",
                       lambda ops, x: ops.permute_rows(x.t(), torch.zeros(2, dtype=torch.int32, device=DEV), None)),
    "scatter_tokens_mismatch": (r"slot_row has 3 tokens, x has 4",
                                lambda ops, x: ops.scatter_rows(x, torch.zeros(3, 2, dtype=torch.int32, device=DEV), 6)),
    "scatter_index_dtype": (r"slot_row\.dtype=Long must be Int",
                            lambda ops, x: ops.scatter_rows(x, torch.zeros(4, 2, dtype=torch.long, device=DEV), 8)),
    "float64": (r"x\.dtype=Double is not supported",
                lambda ops, x: ops.permute_rows(x.double(), torch.zeros(2, dtype=torch.int32, device=DEV), None)),
    "odd_swiglu_width": (r"h has 7 columns", lambda ops, x: ops.weighted_swiglu_fwd(torch.randn(2, 7, device=DEV), None)),
    "unknown_score_func": (r"score_func='tanh' is unknown",
                           lambda ops, x: ops.router_topk(torch.randn(2, 8, device=DEV), None, 2, "tanh", False, True, 1.0, 0, 0)),
    "groups_not_dividing": (r"num_groups=3 must divide E=8",
                            lambda ops, x: ops.router_topk(torch.randn(2, 8, device=DEV), None, 2, "sigmoid", False, True, 1.0, 3, 1)),
    "zero_experts": (r"num_experts=0 must be in",
                     lambda ops, x: ops.build_permutation(torch.zeros(2, 2, dtype=torch.int32, device=DEV), 0)),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_ops_reject_bad_arguments_naming_the_value(ops, case: str) -> None:
    pattern, call = _BAD_CALLS[case]
    with pytest.raises(RuntimeError, match=pattern):
        call(ops, torch.randn(4, 8, device=DEV))
