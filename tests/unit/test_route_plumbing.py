"""The layer's one-call router + permutation path (ops/route.py), run on the CPU.

The csrc ``route`` op needs a GPU; here a stand-in built from the torch references plays it, so
what is checked is the plumbing around it: the layer's choice of path, the autograd node that
carries the logits' gradient to ``x`` and the router weight, the permutation and moved rows
handed to the experts, the deferred counts and the expert-bias bookkeeping. Output and every
gradient must equal the separate calls' (the GPU tests check the op itself, tests/gpu/test_route.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_moe.moe.router as router_module
from lightning_moe import MoEConfig, MoELayer
from lightning_moe.moe.router import select_topk, selection_scores
from lightning_moe.ops.permute import build_permutation_reference


class _ReferenceRoute:
    """What ``torch.ops.lightning_moe_C.route`` returns, computed with the torch references."""

    def __init__(self) -> None:
        self.calls = 0

    def route(self, x, w, bias, top_k, score_func, pre_softmax, norm, scaling, groups, group_topk):  # noqa: ANN001, ANN201
        self.calls += 1
        logits = F.linear(x.float(), w.float())
        scores = selection_scores(logits, score_func, pre_softmax)
        if bias is not None:
            scores = scores + bias
        ids = select_topk(scores, top_k, groups or None, group_topk or None)
        perm = build_permutation_reference(ids, w.shape[0], dropless=True)
        counts = perm.tokens_per_expert_E.int()
        offsets = counts.cumsum(0).int()
        src = perm.src_token_R.int()
        return logits, ids, src, perm.slot_row_TK.int(), counts, offsets, x[src.long()]


def _only_for_16_bit(fake: _ReferenceRoute):  # noqa: ANN202
    """``csrc_extension`` stand-in: the fake for the route call (16-bit x), none for the router's fp32 top-k."""
    return lambda t: fake if t.dtype in (torch.bfloat16, torch.float16) else None


def _step(layer: MoELayer, x: torch.Tensor, go: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(go)
    return y.detach(), x.grad.detach(), {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "extra",
    [dict(), dict(score_func="sigmoid", num_groups=4, group_topk=2, expert_bias=True, scaling_factor=2.5),
     dict(pre_softmax=True, aux_loss="switch", z_loss_coeff=1e-3, shared_expert_ffn_size=16)],
    ids=["softmax", "sigmoid_groups_bias", "aux_losses_shared"],
)  # fmt: skip
def test_one_call_path_equals_separate_calls(extra, monkeypatch) -> None:  # noqa: ANN001
    fake = _ReferenceRoute()
    monkeypatch.setattr(router_module, "csrc_extension", _only_for_16_bit(fake))
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, **extra)
    layer = MoELayer(cfg).to(torch.bfloat16).train()
    x = torch.randn(3, 10, 32, dtype=torch.bfloat16)
    go = torch.randn(3, 10, 32, dtype=torch.bfloat16)

    y1, gx1, g1 = _step(layer, x, go)
    assert fake.calls == 1
    counts1 = layer.last_tokens_per_expert.clone()
    since_update1 = layer.router.tokens_per_expert_since_update.clone() if cfg.expert_bias else None

    monkeypatch.setattr(MoELayer, "_route_and_permute", lambda self, x_TH: None)
    if cfg.expert_bias:
        layer.router.tokens_per_expert_since_update.zero_()
    y2, gx2, g2 = _step(layer, x, go)
    assert fake.calls == 1
    assert torch.equal(y1, y2)
    assert g1.keys() == g2.keys() and "router.weight" in g1
    for name in g1:
        if name != "router.weight":
            assert torch.equal(g1[name], g2[name]), name
    # The router's GEMM gradients: on the CPU the separate calls differentiate the fp32 reference
    # (fp32 GEMMs, one rounding at the end); the one-call node rounds the logits' gradient to 16
    # bits first, as on CUDA (ops/router_gemm.py). Close, not equal; on CUDA both paths share the
    # node's backward and agree bitwise (tests/gpu/test_route.py).
    for got, want in [(gx1, gx2), (g1["router.weight"], g2["router.weight"])]:
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert counts1.dtype == torch.long and torch.equal(counts1, layer.last_tokens_per_expert)
    if cfg.expert_bias:
        assert torch.equal(since_update1, layer.router.tokens_per_expert_since_update)
        assert float(since_update1.sum()) == 30 * 2


@pytest.mark.parametrize(
    "why",
    ["override", "capacity", "fp32_router_weight", "autocast", "no_extension", "unfused_permute", "hidden_not_multiple_of_8"],
)
def test_separate_calls_where_one_call_does_not_apply(why, monkeypatch) -> None:  # noqa: ANN001
    fake = _ReferenceRoute()
    monkeypatch.setattr(router_module, "csrc_extension", (lambda t: None) if why == "no_extension" else _only_for_16_bit(fake))
    H = 36 if why == "hidden_not_multiple_of_8" else 32
    cfg = MoEConfig(
        hidden_size=H, ffn_hidden_size=16, num_experts=8, top_k=2,
        capacity_factor=1.5 if why == "capacity" else None, memory_efficient_permute=why != "unfused_permute",
    )  # fmt: skip
    layer = MoELayer(cfg).to(torch.bfloat16)
    if why == "fp32_router_weight":
        layer.router.float()
    if why == "override":
        layer.router.set_routing_override(lambda ids: ids)
    x = torch.randn(12, H, dtype=torch.bfloat16)
    if why == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        y = layer(x)
    assert torch.isfinite(y.float()).all()
    assert fake.calls == 0


@pytest.mark.parametrize("lean", [True, False])
def test_moved_rows_are_freed_after_the_first_gemm_unless_kept(lean, monkeypatch) -> None:  # noqa: ANN001
    """The rows the one call moved must not outlive the up-projection when backward rebuilds them:
    no frame above the experts may hold them (with wide experts they are the forward's largest buffer)."""
    import weakref

    import lightning_moe.ops.local_experts as local_ops

    fake = _ReferenceRoute()
    rows_ref: list[weakref.ref] = []
    real_route = fake.route

    def route(*args):  # noqa: ANN002, ANN202
        out = real_route(*args)
        rows_ref.append(weakref.ref(out[-1]))
        return out

    fake.route = route  # type: ignore[method-assign]
    monkeypatch.setattr(router_module, "csrc_extension", _only_for_16_bit(fake))
    alive_at_swiglu: list[bool] = []
    real_swiglu = local_ops.weighted_swiglu_forward
    monkeypatch.setattr(
        local_ops, "weighted_swiglu_forward", lambda *a: alive_at_swiglu.append(rows_ref[0]() is not None) or real_swiglu(*a)
    )
    layer = MoELayer(MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2)).to(torch.bfloat16)
    layer.experts.lean_backward = lean
    layer(torch.randn(12, 32, dtype=torch.bfloat16, requires_grad=True))
    assert fake.calls == 1 and alive_at_swiglu == [not lean]
