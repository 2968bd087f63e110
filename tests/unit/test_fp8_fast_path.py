"""The fast FP8 experts path on CPU: its selection rules, the two-pass quantization for exact unit
grids (bitwise the padded path), the FP8 row gather, the weight cache, and the weight gradients in
the activation dtype (``Fp8Config(wgrad="activation")``)."""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_moe.config import Fp8Config
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.fp8 import expert_mlp as fp8_mlp
from lightning_moe.ops.fp8 import weight_cache
from lightning_moe.ops.fp8.choice import local_rows_plan, resolve_wgrad_precision
from lightning_moe.ops.fp8.gemm import auto_fp8_backend, grouped_mm_route
from lightning_moe.ops.fp8.quantize import gather_fp8_rows

Q = importlib.import_module("lightning_moe.ops.fp8.quantize")


# ---- selection rules ---------------------------------------------------------------------------


def test_wgrad_precision_follows_the_backend() -> None:
    assert resolve_wgrad_precision("auto", "emulate") == "fp8"
    assert resolve_wgrad_precision("auto", "torch") == "activation"
    assert resolve_wgrad_precision("auto", "cutlass") == "activation"
    assert resolve_wgrad_precision("fp8", "cutlass") == "fp8"
    assert resolve_wgrad_precision("activation", "emulate") == "activation"
    with pytest.raises(ValueError, match="wgrad='bf16' is not one of"):
        resolve_wgrad_precision("bf16", "torch")


def test_local_rows_plan() -> None:
    assert local_rows_plan("tensorwise", True) == "quantize_moved_rows"
    assert local_rows_plan("tensorwise", False) == "quantize_moved_rows"
    assert local_rows_plan("blockwise", True) == "gather_quantized_tokens"
    assert local_rows_plan("rowwise", False) == "permute_quantize"


def test_auto_backend_takes_cutlass_for_blockwise_on_sm90_only_where_it_builds() -> None:
    asked: list[int] = []

    def ready() -> bool:
        asked.append(1)
        return True

    assert auto_fp8_backend("blockwise", (9, 0), ready) == "cutlass"
    assert auto_fp8_backend("blockwise", (9, 0), lambda: False) == "torch"
    asked.clear()
    assert auto_fp8_backend("rowwise", (9, 0), ready) == "torch"
    assert auto_fp8_backend("blockwise", (8, 9), ready) == "torch"
    assert auto_fp8_backend("blockwise", (10, 0), ready) == "torch"
    assert not asked  # the build is asked only where its answer matters


def test_cutlass_hands_what_its_kernel_refuses_to_torch() -> None:
    assert grouped_mm_route("cutlass", True) == "cutlass"
    assert grouped_mm_route("cutlass", False) == "torch"
    assert grouped_mm_route("torch", True) == "torch"
    assert grouped_mm_route("emulate", False) == "emulate"


# ---- two-pass quantization on exact grids ----------------------------------------------------


def _padded_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Q, "_divides_grid", lambda *a: False)


def _same(a, b) -> None:  # noqa: ANN001
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert a.data.stride() == b.data.stride() and a.scale.shape == b.scale.shape
    assert torch.equal(a.scale.isnan(), b.scale.isnan())
    assert torch.equal(a.scale.nan_to_num(7.0), b.scale.nan_to_num(7.0))


def _hard_input(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, 384, generator=g) * torch.logspace(-30, 3, 384)
    x[0, 3, 5] = float("nan")
    x[1, 130, 200] = float("inf")
    x[1, :128, :128] = 0.0  # a unit of zeros: scale 1
    x[0, 200, 300:] = -x[0, 200, 300:].abs() * 1e3  # the amax from a negative value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("reduce_dim", [-1, -2])
@pytest.mark.parametrize("pow2", [False, True])
def test_exact_grid_quantize_equals_the_padded_path(monkeypatch, dtype, recipe, fmt, reduce_dim, pow2) -> None:
    x = _hard_input(dtype)
    fast = Q.quantize(x, recipe, fmt, reduce_dim=reduce_dim, pow2_scales=pow2)
    _padded_path(monkeypatch)
    _same(fast, Q.quantize(x, recipe, fmt, reduce_dim=reduce_dim, pow2_scales=pow2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("reduce_dim", [-1, -2])
def test_exact_grid_dequantize_equals_the_padded_path(monkeypatch, dtype, recipe, fmt, reduce_dim) -> None:
    q = Q.quantize(_hard_input(torch.float32), recipe, fmt, reduce_dim=reduce_dim)
    fast = q.dequantize(dtype)
    _padded_path(monkeypatch)
    slow = q.dequantize(dtype)
    assert fast.dtype == slow.dtype and fast.is_contiguous()
    assert torch.equal(fast.isnan(), slow.isnan()) and torch.equal(fast.nan_to_num(3.0), slow.nan_to_num(3.0))


def test_the_grid_rule() -> None:
    assert Q._divides_grid(torch.Size([256, 384]), (1, 128))
    assert not Q._divides_grid(torch.Size([256, 200]), (1, 128))
    assert not Q._divides_grid(torch.Size([0, 128]), (1, 128))  # no data: the padded path's empty handling
    assert Q._divides_grid(torch.Size([3, 7]), (None, None))


def test_a_planted_amax_error_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: an amax that forgets the sign (max, not max of |x|) is caught."""
    x = _hard_input(torch.float32)
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, ord, dim: t.amax(dim=dim))  # noqa: A002
    fast = Q.quantize(x, "blockwise", "e4m3")
    _padded_path(monkeypatch)
    slow = Q.quantize(x, "blockwise", "e4m3")
    assert not torch.equal(fast.scale.nan_to_num(7.0), slow.scale.nan_to_num(7.0))


# ---- the FP8 row gather ------------------------------------------------------------------------


@pytest.mark.parametrize("K", [128, 24, 20, 0])
def test_gather_fp8_rows_equals_indexing(K: int) -> None:
    data = torch.randn(10, K).to(torch.float8_e4m3fn)
    for idx in (torch.tensor([3, 3, 0, 9], dtype=torch.int32), torch.zeros(0, dtype=torch.int32)):
        assert torch.equal(gather_fp8_rows(data, idx).view(torch.uint8), data[idx.long()].view(torch.uint8))
    sliced = data[:, : K // 2] if K else data  # not contiguous: the plain gather
    assert torch.equal(gather_fp8_rows(sliced, idx).view(torch.uint8), sliced[idx.long()].view(torch.uint8))


# ---- the weight cache --------------------------------------------------------------------------


def test_weight_cache_reuses_until_the_weight_changes() -> None:
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    a = weight_cache.quantized_weight(w, "fprop", "blockwise", False, cache=True)
    assert weight_cache.quantized_weight(w, "fprop", "blockwise", False, cache=True) is a
    with torch.no_grad():
        w.mul_(2.0)  # an in-place update bumps the version
    b = weight_cache.quantized_weight(w, "fprop", "blockwise", False, cache=True)
    assert b is not a and torch.equal(b.scale, a.scale * 2)
    opt = torch.optim.SGD([w], lr=0.0)
    w.grad = torch.zeros_like(w)
    opt.step()  # lr 0 leaves the values; the step still retires the copy
    assert weight_cache.quantized_weight(w, "fprop", "blockwise", False, cache=True) is not b
    assert weight_cache.quantized_weight(w, "fprop", "blockwise", False, cache=False) is not b


def test_weight_cache_keys_views_uses_and_recipes_apart() -> None:
    base = torch.randn(4, 256, 128)
    w0, w1 = base[:2], base[2:]
    q0 = weight_cache.quantized_weight(w0, "fprop", "blockwise", False, cache=True)
    q1 = weight_cache.quantized_weight(w1, "fprop", "blockwise", False, cache=True)
    want1 = Q.quantize(w1, "blockwise", "e4m3", reduce_dim=-2)
    _same(q1, want1)
    assert q0 is not q1
    d0 = weight_cache.quantized_weight(w0, "dgrad", "blockwise", False, cache=True)
    _same(d0, Q.quantize(w0.transpose(1, 2), "blockwise", "e4m3", reduce_dim=-2))
    # square tiles: the data-gradient operand is the forward's transposed, byte for byte
    assert torch.equal(d0.data.view(torch.uint8), q0.data.transpose(1, 2).view(torch.uint8))
    r0 = weight_cache.quantized_weight(w0, "fprop", "rowwise", False, cache=True)
    assert r0.recipe == "rowwise"
    with pytest.raises(ValueError, match="use='wgrad' is not one of"):
        weight_cache.quantized_weight(w0, "wgrad", "blockwise", False, cache=True)  # type: ignore[arg-type]


def _count_weight_quantizations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = weight_cache._quantize
    monkeypatch.setattr(weight_cache, "_quantize", lambda w, use, *a: (seen.append(use), original(w, use, *a))[1])
    return seen


H, F_, E = 256, 128, 4  # exact 128-wide grids: the two-pass quantization inside the layer


def _experts(**fp8) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(E, H, F_, backend="loop", init_std=0.05, fp8=Fp8Config(backend="emulate", **fp8))
    with torch.no_grad():
        ex.w13[1].mul_(8.0)
    return ex


def _inputs(counts: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    x = torch.randn(R, H, generator=g)
    x[:, 5] *= 30.0
    return x, torch.tensor(counts), torch.rand(R, generator=g) + 0.1, torch.randn(R, H, generator=g)


def _step(ex: GroupedExperts, x, counts, w_R, dy) -> dict:  # noqa: ANN001
    x = x.clone().requires_grad_(True)
    w_R = w_R.clone().requires_grad_(True)
    y = ex(x, counts, w_R)
    y.backward(dy)
    return dict(y=y.detach(), x=x.grad, w13=ex.w13.grad.clone(), w2=ex.w2.grad.clone(), w_R=w_R.grad)


def test_cached_weights_give_the_same_numbers_and_are_quantized_once_per_step(monkeypatch) -> None:
    seen = _count_weight_quantizations(monkeypatch)
    inputs = _inputs([40, 0, 100, 3])
    cached, fresh = _experts(cache_weights=True), _experts(cache_weights=False)
    for _ in range(2):  # two micro-batches of one step
        a, b = _step(cached, *inputs), _step(fresh, *inputs)
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert seen.count("fprop") == 2 + 4 and seen.count("dgrad") == 2 + 4  # cached: 2 + 2; fresh: 4 + 4
    seen.clear()
    torch.optim.SGD(cached.parameters(), lr=0.1).step()
    _step(cached, *inputs)
    assert sorted(seen) == ["dgrad", "dgrad", "fprop", "fprop"]  # quantized again after the update


def test_exact_grid_layer_equals_the_padded_path(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs([130, 0, 1, 125])
    fast = _step(_experts(), *inputs)
    _padded_path(monkeypatch)
    slow = _step(_experts(), *inputs)
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name


# ---- weight gradients in the activation dtype ---------------------------------------------------


def _per_expert_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, lo = [], 0
    for n in counts:
        out.append(x[lo : lo + n].t() @ dy[lo : lo + n])
        lo += n
    return torch.stack(out)


def test_activation_wgrad_is_the_per_expert_product() -> None:
    counts = [5, 0, 7, 0]
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(12, 16, generator=g), torch.randn(12, 24, generator=g)
    offs = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    torch.testing.assert_close(fp8_mlp.activation_wgrad(x, dy, offs), _per_expert_wgrad(x, dy, counts))


@pytest.mark.parametrize("counts", [[40, 0, 100, 3], [0, 0, 77, 0]], ids=["empty_expert", "one_expert"])
def test_activation_wgrad_changes_only_the_weight_gradients(monkeypatch, counts: list[int]) -> None:
    calls: list[tuple] = []
    original = fp8_mlp.activation_wgrad
    monkeypatch.setattr(
        fp8_mlp, "activation_wgrad", lambda x, dy, o: (calls.append((tuple(x.shape), tuple(dy.shape))), original(x, dy, o))[1]
    )
    fp8_wgrads: list[int] = []
    monkeypatch.setattr(fp8_mlp, "fp8_grouped_wgrad", lambda *a, **k: fp8_wgrads.append(1))
    inputs = _inputs(counts)
    R = sum(counts)
    got = _step(_experts(wgrad="activation"), *inputs)
    assert calls == [((R, F_), (R, H)), ((R, H), (R, 2 * F_))] and not fp8_wgrads
    monkeypatch.undo()
    want = _step(_experts(wgrad="fp8"), *inputs)
    for name in ("y", "x", "w_R"):
        assert torch.equal(got[name], want[name]), name
    for name in ("w13", "w2"):  # FP8 operands against unquantized ones: close, not equal
        rel = float((got[name] - want[name]).norm() / want[name].norm())
        assert 0 < rel < 0.1, (name, rel)


def test_a_torch_that_cannot_store_fp8_from_a_division_falls_back_with_a_warning(monkeypatch) -> None:
    x = _hard_input(torch.float16)  # a source the two-pass path takes (bf16 sources take the padded path)
    want = Q.quantize(x, "blockwise", "e4m3")

    def refuse(*a, **k):
        raise RuntimeError("div_true not implemented for 'Float8_e4m3fn'")

    monkeypatch.setattr(Q, "_quantize_exact_grid", refuse)
    monkeypatch.setattr(Q, "_NO_FP8_STORE", set())
    with pytest.warns(UserWarning, match="two-pass path is unavailable"):
        got = Q.quantize(x, "blockwise", "e4m3")
    _same(got, want)
    assert Q._NO_FP8_STORE == {"cpu"}
    _same(Q.quantize(x, "blockwise", "e4m3"), want)  # asked once per device type


@pytest.mark.parametrize("save_fp8", [True, False])
def test_activation_wgrad_under_autocast_with_fp32_rows(save_fp8: bool) -> None:
    """fp32 rows into bf16-autocast experts: the weight gradients run in bf16, as the bf16 experts'."""
    ex = _experts(wgrad="activation", save_fp8_activations=save_fp8)
    x, counts, w_R, dy = _inputs([40, 0, 100, 3])
    x = x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, counts, w_R)
    y.float().backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert ex.w13.grad.dtype == torch.float32 and torch.isfinite(ex.w13.grad).all() and ex.w13.grad.abs().sum() > 0
