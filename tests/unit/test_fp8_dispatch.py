"""FP8 token dispatch on one process: the rows quantized once, scales carried, gradients in full precision.

Multi-rank parity (all-to-all, flex over alltoall_dedup and the DeepEP stand-in, ETP) runs in
tests/dist/test_dist_fp8_dispatch.py; here: the local dispatcher, the wire format, and refusals.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.moe.dispatch import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    AllToAllTokenExchange,
    DeepEPExchange,
    DispatcherCapabilities,
    FlexDispatcher,
    HybridEPExchange,
    LocalDispatcher,
)
from lightning_moe.moe.dispatch.base import fp8_rows_for, fp8_rows_of
from lightning_moe.moe.dispatch.fp8_rows import gather_rows, pack_rows, row_bytes, scales_per_row, unpack_rows
from lightning_moe.ops.fp8.quantize import quantize
from lightning_moe.ops.fp8.recipe import FP8_DTYPE

SPECS = [("rowwise", "e4m3", False), ("blockwise", "e4m3", False), ("blockwise", "e5m2", True), ("rowwise", "e5m2", True)]


class _Group:
    """Just enough of a process group to build an expert-parallel dispatcher (no collective runs)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def _quantize_one_row(x_H: torch.Tensor, spec: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one row quantized on its own (data bytes, scales)."""
    recipe, fmt, pow2 = spec
    tile = (1, 128) if recipe == "blockwise" else None
    q = quantize(x_H.view(1, -1), recipe, fmt, tile=tile, pow2_scales=pow2)
    return q.data.view(torch.uint8)[0], q.scale[0]


def _routing(T: int, E: int, K: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skew:  # expert 0 gets everything it can, expert E-1 nothing, a slot dropped
        ids[:, 0] = 0
        ids[ids == E - 1] = 1 if K > 1 else 0
        ids[:, -1] = torch.where(ids[:, -1] == ids[:, 0], -1, ids[:, -1])
        ids[0, -1] = -1
    return ids, torch.rand(T, K, generator=g) * (ids >= 0)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("H", [200, 256, 130])
@pytest.mark.parametrize("skew", [False, True])
def test_local_fp8_rows_are_each_token_quantized_alone_in_expert_order(spec: tuple, H: int, skew: bool) -> None:
    torch.manual_seed(H)
    T, E, K = 9, 4, 2
    x = torch.randn(T, H) * torch.logspace(-3, 3, T).unsqueeze(1)  # rows of very different magnitudes
    ids, w = _routing(T, E, K, seed=H, skew=skew)
    disp = LocalDispatcher(E)
    disp.fp8_rows = spec
    d, handle = disp.dispatch(x, ids, w, None)
    q = d.x_fp8
    assert q is not None and q.recipe == spec[0] and q.fmt == spec[1] and q.data.dtype == FP8_DTYPE[spec[1]]
    assert q.data.is_contiguous() and q.scale.is_contiguous()
    R = int((ids >= 0).sum())
    assert q.data.shape == (R, H) and q.scale.shape == (R, scales_per_row(H, spec[0]))
    plain, _ = LocalDispatcher(E).dispatch(x, ids, w, None)
    torch.testing.assert_close(d.tokens_per_expert_e, plain.tokens_per_expert_e)
    torch.testing.assert_close(d.weights_R, plain.weights_R)
    for r, t in enumerate(handle.perm.src_token_R.tolist()):
        data_H, scale_S = _quantize_one_row(x[t], spec)
        assert torch.equal(q.data.view(torch.uint8)[r], data_H), f"row {r} (token {t}): data differs"
        assert torch.equal(q.scale[r], scale_S), f"row {r} (token {t}): scales differ"
    # the rows the experts see are the activation-dtype rows, up to FP8 rounding
    torch.testing.assert_close(q.dequantize(), plain.x_RH, rtol=0.07 if spec[1] == "e4m3" else 0.14, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placeholder_is_zero_strided_zeros_in_the_activation_dtype(dtype: torch.dtype) -> None:
    T, H, E, K = 6, 64, 4, 2
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    ids, w = _routing(T, E, K, seed=1)
    disp = LocalDispatcher(E)
    disp.fp8_rows = ("rowwise", "e4m3", False)
    d, _ = disp.dispatch(x, ids, w, None)
    assert d.x_RH.shape == (T * K, H) and d.x_RH.dtype == dtype and d.x_RH.stride() == (0, 0)
    assert d.x_RH.requires_grad and not d.x_RH.any()
    with torch.no_grad():  # evaluation: the same rows, no graph
        d2, _ = disp.dispatch(x, ids, w, None)
    assert not d2.x_RH.requires_grad and torch.equal(d2.x_fp8.data.view(torch.uint8), d.x_fp8.data.view(torch.uint8))


def _fake_experts(x_RH: torch.Tensor, rows_e: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Per-expert SwiGLU (independent of the package's experts)."""
    out, start = [], 0
    F = w2.shape[1]
    for e, n in enumerate(rows_e.tolist()):
        h = x_RH[start : start + n] @ w13[e]
        out.append((torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2[e])
        start += n
    return torch.cat(out) if out else x_RH.new_zeros(0, w2.shape[-1])


@pytest.mark.parametrize("spec", SPECS[:2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("case", ["random", "skew", "zero_tokens", "all_to_one"])
def test_local_fp8_dispatch_output_and_gradients_equal_the_straight_through_reference(
    spec: tuple, weighted: bool, case: str
) -> None:
    """Output and gradients of x, w13, w2 and the routing weights equal the activation-dtype path fed the
    fake-quantized tokens with a straight-through gradient (fp32)."""
    torch.manual_seed(3)
    T, H, F, E, K = (0 if case == "zero_tokens" else 11), 160, 24, 4, 2
    x0 = torch.randn(T, H)
    ids, w0 = _routing(T, E, K, seed=7, skew=case == "skew")
    if case == "all_to_one":
        ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.full((T,), -1)], dim=1)
        w0 = w0 * (ids >= 0)
    w13_0, w2_0 = torch.randn(E, H, 2 * F) * 0.1, torch.randn(E, F, H) * 0.1
    c = torch.randn(T, H)

    def run(fp8: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        w13, w2 = w13_0.clone().requires_grad_(), w2_0.clone().requires_grad_()
        disp = LocalDispatcher(E)
        if fp8:
            disp.fp8_rows = spec
            d, handle = disp.dispatch(x, ids, w, None)
            rows = d.x_fp8.dequantize() + d.x_RH  # the placeholder carries the gradient
        else:
            tile = (1, 128) if spec[0] == "blockwise" else None
            xq = quantize(x.detach(), spec[0], spec[1], tile=tile, pow2_scales=spec[2]).dequantize()
            d, handle = disp.dispatch(x + (xq - x).detach(), ids, w, None)
            rows = d.x_RH
        y_R = _fake_experts(rows, d.tokens_per_expert_e, w13, w2)
        if not weighted:
            y_R = y_R * d.weights_R.unsqueeze(-1)
        y = disp.combine(y_R, handle, weighted=weighted)
        (y * c).sum().backward()
        return y.detach(), x.grad, w.grad, w13.grad, w2.grad

    got, want = run(True), run(False)
    for name, g, r in zip(("output", "grad x", "grad weights", "grad w13", "grad w2"), got, want):
        assert g is not None and r is not None, name
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    if case == "all_to_one" and T:
        assert not got[3][1:].any()  # experts with no row: zero weight gradients


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("H", [1, 3, 128, 130, 2048])
def test_packed_rows_round_trip_bit_for_bit(spec: tuple, H: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, H) * 10
    x[2, 0] = float("nan")  # a non-finite unit stays non-finite through the wire
    x[3] = 0.0
    tile = (1, 128) if spec[0] == "blockwise" else None
    q = quantize(x, spec[0], spec[1], tile=tile, pow2_scales=spec[2])
    index = torch.tensor([6, 0, 0, 3, 2])
    packed = pack_rows(q, index)
    assert packed.dtype == torch.uint8 and packed.shape == (5, row_bytes(H, spec))
    back = unpack_rows(packed, H, spec)
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8)[index])
    assert torch.equal(back.scale.view(torch.int32), q.scale[index].view(torch.int32))  # NaN scales too
    assert back.recipe == q.recipe and back.fmt == q.fmt and back.tile == q.tile and back.reduce_dim == -1
    regrouped = gather_rows(back, torch.tensor([4, 1]))
    assert regrouped.data.is_contiguous() and regrouped.scale.is_contiguous()
    assert torch.equal(regrouped.data.view(torch.uint8), q.data.view(torch.uint8)[torch.tensor([2, 0])])
    assert torch.isnan(regrouped.dequantize()[0, :128]).all()  # the NaN unit dequantizes to NaN throughout
    empty = unpack_rows(pack_rows(q, torch.zeros(0, dtype=torch.long)), H, spec)
    assert empty.data.shape == (0, H)


@pytest.mark.parametrize("H", [2048, 7168, 256])
def test_a_packed_row_is_about_half_a_bfloat16_row(H: int) -> None:
    for recipe in ("rowwise", "blockwise"):
        ratio = row_bytes(H, (recipe, "e4m3", False)) / (2 * H)
        assert 0.5 < ratio <= 0.516, (recipe, H, ratio)


def test_unpack_refuses_rows_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="do not hold H=128"):
        unpack_rows(torch.zeros(2, 100, dtype=torch.uint8), 128, ("rowwise", "e4m3", False))


@pytest.mark.filterwarnings("ignore:HybridEPExchange")
def test_capabilities_name_who_carries_fp8_rows() -> None:
    group = _Group()
    assert LocalDispatcher(4).capabilities.carries_fp8_rows
    assert AllToAllDispatcher(4, ep_group=group).capabilities.carries_fp8_rows  # type: ignore[arg-type]
    assert FlexDispatcher(4, ep_group=group, exchange=AllToAllTokenExchange(group)).capabilities.carries_fp8_rows  # type: ignore[arg-type]
    assert FlexDispatcher(4, ep_group=group, exchange=DeepEPExchange(object())).capabilities.carries_fp8_rows  # type: ignore[arg-type]
    assert not AllGatherDispatcher(4, ep_group=group).capabilities.carries_fp8_rows  # type: ignore[arg-type]
    hybrid = HybridEPExchange(group, 4, make_buffer=lambda h, t: None)  # type: ignore[arg-type]
    assert not FlexDispatcher(4, ep_group=group, exchange=hybrid).capabilities.carries_fp8_rows  # type: ignore[arg-type]
    assert DispatcherCapabilities().carries_fp8_rows is False


@pytest.mark.filterwarnings("ignore:HybridEPExchange")
def test_dispatchers_that_cannot_carry_fp8_rows_refuse_them_naming_the_fix() -> None:
    group = _Group()
    x, ids, w = torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    allgather = AllGatherDispatcher(4, ep_group=group)  # type: ignore[arg-type]
    allgather.fp8_rows = ("blockwise", "e4m3", False)  # type: ignore[attr-defined]
    fix = r"choose dispatcher='alltoall'.*Fp8Config\(dispatch=False\)"
    with pytest.raises(ValueError, match=rf"AllGatherDispatcher: FP8 token dispatch .*{fix}"):
        allgather.dispatch(x, ids, w, None)  # refused before any collective
    hybrid = HybridEPExchange(group, 4, make_buffer=lambda h, t: None)  # type: ignore[arg-type]
    flex = FlexDispatcher(4, ep_group=group, exchange=hybrid)  # type: ignore[arg-type]
    flex.fp8_rows = ("rowwise", "e4m3", False)
    with pytest.raises(ValueError, match=rf"FlexDispatcher\(hybridep\): FP8 token dispatch .*{fix}"):
        flex.dispatch(x, ids, w, None)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (("tensorwise", "e4m3", False), ValueError, r"recipe='tensorwise' cannot be quantized per row.*dispatch=False"),
        (("blocks", "e4m3", False), ValueError, r"recipe='blocks'"),
        (("rowwise", "e3m4", False), ValueError, r"fmt='e3m4' is unknown; choose 'e4m3' or 'e5m2'"),
        (("rowwise", "e4m3", 1), TypeError, r"pow2_scales=1 is not a bool"),
        (("rowwise", "e4m3"), TypeError, r"is not a \(recipe, fmt, pow2_scales\) tuple"),
        ("rowwise", TypeError, r"is not a \(recipe, fmt, pow2_scales\) tuple"),
    ],
)
def test_bad_fp8_rows_are_refused_at_dispatch(spec: object, error: type, match: str) -> None:
    disp = LocalDispatcher(4)
    disp.fp8_rows = spec  # type: ignore[assignment]
    with pytest.raises(error, match=rf"LocalDispatcher: fp8_rows .*{match}" if "tuple" not in match else match):
        disp.dispatch(torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2), None)
    disp.fp8_rows = None
    assert fp8_rows_of(disp) is None


class _NoCallsBuffer:
    """A DeepEP buffer that must never be reached."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the DeepEP buffer was called ({name}) before the FP8 rows were checked")


@pytest.mark.parametrize(
    ("spec", "H"), [(("rowwise", "e4m3", False), 256), (("blockwise", "e5m2", False), 256), (("blockwise", "e4m3", False), 200)]
)
def test_deepep_refuses_fp8_rows_it_cannot_move_before_any_communication(spec: tuple, H: int) -> None:
    exchange = DeepEPExchange(_NoCallsBuffer())
    tile = (1, 128) if spec[0] == "blockwise" else None
    q = quantize(torch.randn(4, H), spec[0], spec[1], tile=tile)
    with pytest.raises(ValueError, match=r"DeepEPExchange: DeepEP moves FP8 rows as e4m3 data with one fp32 scale per 128"):
        exchange.dispatch_fp8(q, torch.tensor([[0, 1]] * 4), torch.rand(4, 2), 4)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("skew", [False, True])
def test_fp8_experts_given_the_dispatched_fp8_rows_equal_fp8_experts_quantizing_the_rows_themselves(
    recipe: str, skew: bool
) -> None:
    """The FP8 experts take ``x_fp8`` as their first GEMM's input: the same rows they would quantize
    from activation-dtype rows, so output and every gradient are the same (one process, fp32)."""
    from lightning_moe.config import Fp8Config
    from lightning_moe.moe.experts import GroupedExperts

    torch.manual_seed(5)
    T, H, F, E, K = 10, 192, 16, 4, 2
    fp8 = Fp8Config(recipe=recipe, backend="emulate")  # type: ignore[arg-type]
    experts = GroupedExperts(E, H, F, fp8=fp8)
    x0, c = torch.randn(T, H), torch.randn(T, H)
    ids, w0 = _routing(T, E, K, seed=11, skew=skew)

    def run(fp8_rows: tuple | None):
        twin = GroupedExperts(E, H, F, fp8=fp8)
        twin.load_state_dict(experts.state_dict())
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        disp = LocalDispatcher(E)
        disp.fp8_rows = fp8_rows
        d, handle = disp.dispatch(x, ids, w, None)
        y_R = twin(d.x_RH, d.tokens_per_expert_e, d.weights_R, x_fp8=d.x_fp8)
        y = disp.combine(y_R, handle, weighted=False)
        (y * c).sum().backward()
        return y.detach(), x.grad, w.grad, twin.w13.grad, twin.w2.grad

    got, want = run((recipe, "e4m3", False)), run(None)
    for name, g, r in zip(("output", "grad x", "grad weights", "grad w13", "grad w2"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    ("fp8_kwargs", "rows"),
    [
        ({"recipe": "blockwise"}, ("blockwise", "e4m3", False)),
        ({"recipe": "rowwise", "pow2_scales": True}, ("rowwise", "e4m3", True)),
        ({"recipe": "blockwise", "dispatch": False}, None),
        ({"recipe": "tensorwise"}, None),  # one scale per tensor: the experts quantize the rows themselves
    ],
)
def test_moe_layer_asks_its_dispatcher_for_the_fp8_rows_its_experts_take(fp8_kwargs: dict, rows: tuple | None) -> None:
    """The layer sets ``dispatcher.fp8_rows`` from its FP8 experts; the result equals the FP8 experts
    quantizing activation-dtype rows (fp32), and the experts get the dispatched FP8 rows."""
    from lightning_moe.config import Fp8Config, MoEConfig
    from lightning_moe.moe import MoELayer

    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=128, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss="none",
        fp8=Fp8Config(backend="emulate", **fp8_kwargs), memory_efficient_permute=False,
    )  # fmt: skip
    layer, reference = MoELayer(cfg), MoELayer(cfg)
    reference.load_state_dict(layer.state_dict())
    reference.dispatcher.capabilities = DispatcherCapabilities()  # carries no FP8 rows: asked for none
    seen: list[object] = []
    original = layer.experts.forward
    layer.experts.forward = lambda *a, **k: seen.append(k.get("x_fp8")) or original(*a, **k)  # type: ignore[method-assign]
    x = torch.randn(2, 5, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), reference(x_ref)
    assert layer.dispatcher.fp8_rows == rows and reference.dispatcher.fp8_rows is None
    assert (seen[0] is not None) == (rows is not None), "the experts' FP8 rows do not follow fp8_rows"
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.experts.w13.grad, reference.experts.w13.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.experts.w2.grad, reference.experts.w2.grad, rtol=1e-6, atol=1e-6)


def test_a_layer_on_a_dispatcher_without_fp8_rows_moves_activation_dtype_rows() -> None:
    group = _Group()
    allgather = AllGatherDispatcher(4, ep_group=group)  # type: ignore[arg-type]
    assert fp8_rows_for(allgather, ("blockwise", "e4m3", False)) is None
    assert fp8_rows_for(LocalDispatcher(4), ("blockwise", "e4m3", False)) == ("blockwise", "e4m3", False)
    assert fp8_rows_for(LocalDispatcher(4), None) is None


def test_each_token_is_quantized_once_whatever_its_number_of_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    quantize_module = importlib.import_module("lightning_moe.ops.fp8.quantize")  # the package re-exports the function
    calls: list[tuple[int, ...]] = []
    original = quantize_module.quantize
    monkeypatch.setattr(quantize_module, "quantize", lambda x, *a, **k: calls.append(tuple(x.shape)) or original(x, *a, **k))
    T, H, E, K = 7, 128, 8, 4
    ids, w = _routing(T, E, K, seed=2)
    disp = LocalDispatcher(E)
    disp.fp8_rows = ("blockwise", "e4m3", False)
    d, _ = disp.dispatch(torch.randn(T, H), ids, w, None)
    assert calls == [(T, H)] and d.x_fp8.data.shape == (T * K, H)
