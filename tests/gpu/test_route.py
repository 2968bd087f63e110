"""The router's logits kernel and the one-call router + permutation (csrc route) on CUDA.

Every output is checked against a plain-PyTorch reference on random inputs: the logits kernel
against an fp32 GEMM (outputs poisoned first), ``route`` against the four ops it stands for
(bitwise), and the layer taking the one-call path against the same layer taking the separate
calls (bitwise: same kernels) and against the torch path.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

import lightning_moe.moe.router as router_module  # noqa: E402
from lightning_moe import MoEConfig, MoELayer  # noqa: E402
from lightning_moe.ops.build import load_extension  # noqa: E402

from test_kernels import ROUTERS, _assert_close, _call_poisoned  # noqa: E402  (same folder)
from test_layer_gpu import _run  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def ops():
    return load_extension(mode="csrc")


@pytest.mark.parametrize("tile_tokens", [0, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("T", "H", "E"),
    [(1, 8, 1), (257, 40, 7), (300, 2048, 128), (129, 7168, 256), (130, 96, 129), (64, 8, 1000), (0, 64, 8)],
)
def test_router_logits_matches_an_fp32_gemm(ops, T, H, E, dtype, tile_tokens) -> None:
    gen = torch.Generator().manual_seed(T * 7 + H + E)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    w = (torch.randn(E, H, generator=gen) * 0.05).to(DEV, dtype)
    logits = _call_poisoned(lambda: ops.router_logits(x, w, tile_tokens), [((T, E), torch.float32)])
    expected = x.double() @ w.double().t()  # products of 16-bit values are exact; only the order of sums differs
    _assert_close(logits, expected.float(), 2e-5, f"router_logits T={T} H={H} E={E}")


@pytest.mark.parametrize(
    ("pattern", "call"),
    [
        (r"must both be bfloat16 or both float16",
         lambda ops: ops.router_logits(torch.randn(4, 8, device=DEV), torch.randn(2, 8, device=DEV))),
        (r"must both be bfloat16 or both float16",
         lambda ops: ops.router_logits(torch.randn(4, 8, device=DEV, dtype=torch.bfloat16),
                                       torch.randn(2, 8, device=DEV, dtype=torch.float16))),
        (r"H=12 must be a multiple of 8",
         lambda ops: ops.router_logits(torch.randn(4, 12, device=DEV, dtype=torch.bfloat16),
                                       torch.randn(2, 12, device=DEV, dtype=torch.bfloat16))),
        (r"hidden sizes must agree",
         lambda ops: ops.router_logits(torch.randn(4, 16, device=DEV, dtype=torch.bfloat16),
                                       torch.randn(2, 8, device=DEV, dtype=torch.bfloat16))),
        (r"tile_tokens=32 must be 0",
         lambda ops: ops.router_logits(torch.randn(4, 8, device=DEV, dtype=torch.bfloat16),
                                       torch.randn(2, 8, device=DEV, dtype=torch.bfloat16), 32)),
        (r"not 16-byte aligned",
         lambda ops: ops.router_logits(torch.randn(33, 8, device=DEV, dtype=torch.bfloat16).view(-1)[1:257].view(32, 8),
                                       torch.randn(2, 8, device=DEV, dtype=torch.bfloat16))),
    ],
    ids=["fp32", "mixed", "H_not_multiple_of_8", "H_mismatch", "tile_tokens", "misaligned"],
)
def test_router_logits_rejects_bad_arguments(ops, pattern, call) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match=pattern):
        call(ops)


@pytest.mark.parametrize("T", [1, 333])
@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "mixtral_pre_softmax", "odd_E33_groups", "sigmoid_no_norm"])
def test_route_equals_the_four_ops(ops, name, T) -> None:
    E, K, score_func, pre, norm, scaling, G, gk, with_bias = ROUTERS[name]
    H = 64
    gen = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(E, H, generator=gen) * 0.1).to(DEV, torch.bfloat16)
    bias = torch.randn(E, generator=gen).to(DEV) if with_bias else None
    args = (bias, K, score_func, pre, norm, scaling, G, gk)
    logits, ids, src, slot_row, counts, offsets, rows = ops.route(x, w, *args)
    ref_logits = ops.router_logits(x, w)
    ref_ids, _ = ops.router_topk(ref_logits, *args)
    ref_src, ref_slot_row, ref_counts, ref_offsets = ops.build_permutation(ref_ids, E)
    ref_rows = ops.scatter_rows(x, ref_slot_row, T * K)
    for got, want, what in [
        (logits, ref_logits, "logits"), (ids, ref_ids, "ids"), (src, ref_src, "src_idx"),
        (slot_row, ref_slot_row, "slot_row"), (counts, ref_counts, "counts"), (offsets, ref_offsets, "offsets"),
        (rows, ref_rows, "rows"),
    ]:  # fmt: skip
        assert got.dtype == want.dtype and torch.equal(got, want), what
    assert torch.equal(rows, x[src.long()]), "rows are x's rows in expert order"


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(score_func="sigmoid", num_groups=4, group_topk=2, expert_bias=True, scaling_factor=2.5),
        dict(pre_softmax=True, aux_loss="switch", z_loss_coeff=1e-3, shared_expert_ffn_size=32),
    ],
    ids=["qwen3_like", "deepseek_like", "aux_losses_shared"],
)
def test_layer_one_call_path_equals_separate_calls(ops, extra, monkeypatch) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=128, ffn_hidden_size=64, num_experts=16, top_k=4, **extra)
    layer = MoELayer(cfg).cuda().to(torch.bfloat16).train()
    x = torch.randn(2, 150, 128, device=DEV, dtype=torch.bfloat16)
    go = torch.randn(2, 150, 128, device=DEV, dtype=torch.bfloat16)

    calls = []
    real_route = router_module.route
    monkeypatch.setattr(router_module, "route", lambda *a, **k: calls.append(1) or real_route(*a, **k))
    y1, gx1, g1 = _run(layer, x, go, "csrc", monkeypatch)
    assert calls, "the one-call path did not run"
    counts1 = layer.last_tokens_per_expert.clone()
    bias_counts1 = layer.router.tokens_per_expert_since_update.clone() if cfg.expert_bias else None

    monkeypatch.setattr(MoELayer, "_route_and_permute", lambda self, x_TH: None)
    if cfg.expert_bias:
        layer.router.tokens_per_expert_since_update.zero_()
    y2, gx2, g2 = _run(layer, x, go, "csrc", monkeypatch)
    assert len(calls) == 1
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert g1.keys() == g2.keys() and "router.weight" in g1
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
    assert counts1.dtype == layer.last_tokens_per_expert.dtype == torch.long
    assert torch.equal(counts1, layer.last_tokens_per_expert)
    assert int(counts1.sum()) == 300 * 4
    if cfg.expert_bias:
        assert torch.equal(bias_counts1, layer.router.tokens_per_expert_since_update)


def test_layer_takes_the_separate_calls_where_the_one_call_does_not_apply(monkeypatch) -> None:  # noqa: ANN001
    calls = []
    real_route = router_module.route
    monkeypatch.setattr(router_module, "route", lambda *a, **k: calls.append(1) or real_route(*a, **k))
    x = torch.randn(40, 64, device=DEV, dtype=torch.bfloat16)
    for cfg in [
        MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, capacity_factor=1.5),
        MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, memory_efficient_permute=False),
    ]:
        layer = MoELayer(cfg).cuda().to(torch.bfloat16)
        assert torch.isfinite(layer(x)).all()
    layer = MoELayer(MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)).cuda()  # fp32 weights
    assert torch.isfinite(layer(x.float())).all()
    assert not calls


def _fill_kernels(layer: MoELayer, x: torch.Tensor, go: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> int:
    from torch.profiler import ProfilerActivity, profile

    _run(layer, x, go, "csrc", monkeypatch)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _run(layer, x, go, "csrc", monkeypatch)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "FillFunctor" in e.key)


def test_one_call_path_fills_no_more_than_separate_calls(ops, monkeypatch) -> None:  # noqa: ANN001
    """The one-call node must not get a zero-filled gradient for its moved rows (an [R, H] fill)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=128, ffn_hidden_size=64, num_experts=16, top_k=4)).cuda().to(torch.bfloat16)
    x = torch.randn(300, 128, device=DEV, dtype=torch.bfloat16)
    go = torch.randn(300, 128, device=DEV, dtype=torch.bfloat16)
    one_call = _fill_kernels(layer, x, go, monkeypatch)
    monkeypatch.setattr(MoELayer, "_route_and_permute", lambda self, x_TH: None)
    assert one_call <= _fill_kernels(layer, x, go, monkeypatch)
