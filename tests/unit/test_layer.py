"""MoELayer end to end: dense per-token reference, memory-efficient permutation, capacity and
padding, published hooks, errors, and the model-walking helpers.

Legend: T tokens, H hidden, F expert FFN width, E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.router import expert_capacity
from lightning_moe.moe.utils import find_moe_layers, update_expert_biases

ATOL, RTOL = 1e-5, 1e-5  # fp32, O(1) activations, H = F = 8

BASE = dict(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, aux_loss="none")
LAYER_CASES = {
    "softmax_dropless": dict(),
    "pre_softmax_top1": dict(top_k=1, pre_softmax=True),
    "sigmoid_groups_scaled": dict(
        num_experts=8, top_k=4, score_func="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0
    ),
    "capacity_probs": dict(capacity_factor=0.75, drop_policy="probs"),
    "capacity_position_padded": dict(capacity_factor=0.75, drop_policy="position", pad_to_capacity=True),
    "shared_expert_gated": dict(shared_expert_ffn_size=12, shared_expert_gate=True),
    "weight_in_combine": dict(memory_efficient_permute=False, capacity_factor=1.0),
    "loop_backend": dict(experts_backend="loop", shared_expert_ffn_size=4),
}


def _make_layer(seed: int = 0, **overrides) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**{**BASE, **overrides}), layer_name="blocks.0.mlp")
    with torch.no_grad():  # O(1) weights so that routing and outputs are far from zero
        layer.router.weight.normal_(std=0.7)
        layer.experts.w13.normal_(std=0.4)
        layer.experts.w2.normal_(std=0.4)
        if layer.shared_expert is not None:
            for p in layer.shared_expert.parameters():
                p.normal_(std=0.4)
    return layer.train()


def dense_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Per token: ``sum_k w_tk * expert_{id_tk}(x_t)`` (dropped ids skipped) + shared expert.

    Routing comes from ``layer.router`` (tested on its own in test_router.py), so gradients reach
    the router weight; everything after it is written out here.
    """
    cfg = layer.config
    x_TH = x.reshape(-1, cfg.hidden_size)
    routing = layer.router(x_TH)
    ffn = cfg.ffn_hidden_size
    rows = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros(cfg.hidden_size)
        for k in range(cfg.top_k):
            e = int(routing.topk_ids_TK[t, k])
            if e < 0:
                continue
            h = x_TH[t] @ layer.experts.w13[e]
            acc = acc + routing.topk_weights_TK[t, k] * ((F.silu(h[:ffn]) * h[ffn:]) @ layer.experts.w2[e])
        rows.append(acc)
    y_TH = torch.stack(rows)
    se = layer.shared_expert
    if se is not None:
        fs = cfg.shared_expert_ffn_size
        gu = x_TH @ se.gate_up.weight.T
        shared = (F.silu(gu[:, :fs]) * gu[:, fs:]) @ se.down.weight.T
        if se.gate is not None:
            shared = torch.sigmoid(x_TH @ se.gate.weight.T) * shared
        y_TH = y_TH + shared
    return y_TH.view_as(x)


def _forward_backward(fn, module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    module.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_(True)
    y = fn(xa)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach(), xa.grad, grads


def _assert_same(a, b, atol: float = ATOL, rtol: float = RTOL) -> None:
    y_a, gx_a, grads_a = a
    y_b, gx_b, grads_b = b
    torch.testing.assert_close(y_a, y_b, atol=atol, rtol=rtol, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(gx_a, gx_b, atol=atol, rtol=rtol, msg=lambda m: f"grad x: {m}")
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(
            grads_a[name], grads_b[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def _data(shape: tuple[int, ...] = (2, 8, 8), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_matches_dense_per_token_reference_forward_and_grads(case: str) -> None:
    layer = _make_layer(**LAYER_CASES[case])
    x, g = _data()
    got = _forward_backward(layer, layer, x, g)
    expected = _forward_backward(lambda x: dense_reference(layer, x), layer, x, g)
    _assert_same(got, expected)
    assert set(got[2]) == {n for n, _ in layer.named_parameters()}  # every parameter got a gradient
    if layer.config.capacity_factor is not None and case != "weight_in_combine":
        assert layer.last_dropped_fraction > 0  # the capacity case really drops slots


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(capacity_factor=0.75),
        dict(capacity_factor=0.75, drop_policy="position", pad_to_capacity=True),
        dict(score_func="sigmoid", norm_topk_prob=False, shared_expert_ffn_size=8, shared_expert_gate=True),
        dict(experts_backend="loop", top_k=3),
    ],
    ids=["dropless", "capacity", "padded", "sigmoid_shared", "loop_backend"],
)
def test_memory_efficient_permute_matches_weight_in_combine(overrides: dict) -> None:
    fused = _make_layer(memory_efficient_permute=True, **overrides)
    plain = _make_layer(memory_efficient_permute=False, **overrides)
    plain.load_state_dict(fused.state_dict())
    x, g = _data(seed=3)
    _assert_same(_forward_backward(fused, fused, x, g), _forward_backward(plain, plain, x, g), atol=1e-6, rtol=1e-5)


def _rows_seen_by_experts(layer: MoELayer) -> list[int]:
    """Row counts the experts ran on (through the fused local path or the generic one)."""
    seen: list[int] = []
    experts = layer.experts
    plain, fused = experts.forward, experts.forward_local

    def forward(x_RH, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(x_RH.shape[0])
        return plain(x_RH, *args, **kwargs)

    def forward_local(x_TH, perm, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(perm.num_rows)
        return fused(x_TH, perm, *args, **kwargs)

    experts.forward, experts.forward_local = forward, forward_local
    return seen


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pad_to_capacity_gives_static_rows_and_same_output_as_unpadded(policy: str) -> None:
    # capacity_factor=1 gives room for exactly T*K slots: any imbalance both drops slots of the
    # busiest expert and leaves padding rows in the others.
    unpadded = _make_layer(capacity_factor=1.0, drop_policy=policy)
    padded = _make_layer(capacity_factor=1.0, drop_policy=policy, pad_to_capacity=True)
    padded.load_state_dict(unpadded.state_dict())
    rows_unpadded, rows_padded = _rows_seen_by_experts(unpadded), _rows_seen_by_experts(padded)
    x, g = _data(seed=5)
    _assert_same(_forward_backward(padded, padded, x, g), _forward_backward(unpadded, unpadded, x, g), atol=1e-6)

    T, K, E = 16, 2, 4
    cap = expert_capacity(T, K, E, 1.0)
    assert cap == 8
    counts = unpadded.last_tokens_per_expert
    assert unpadded.last_dropped_fraction > 0 and padded.last_dropped_fraction == unpadded.last_dropped_fraction
    assert rows_padded == [E * cap]
    assert rows_unpadded == [int(counts.clamp(max=cap).sum())]
    assert rows_unpadded[0] < E * cap  # so padding rows really were present
    # a second batch with different routing keeps the padded row count
    padded(torch.randn(3, 5, 8))
    assert rows_padded == [E * cap, E * expert_capacity(15, K, E, 1.0)]
    padded(torch.randn(2, 8, 8))
    assert rows_padded[-1] == E * cap


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_last_dropped_fraction_counts_slots_over_capacity(policy: str) -> None:
    layer = _make_layer(capacity_factor=0.75, drop_policy=policy)
    x, _ = _data(seed=7)
    layer(x)
    cap = expert_capacity(16, 2, 4, 0.75)
    counts = layer.last_tokens_per_expert.tolist()
    assert sum(counts) == 32
    dropped = sum(max(0, c - cap) for c in counts)  # every slot past an expert's capacity is dropped
    assert dropped >= 8  # 32 slots, room for 4 * 6 = 24
    assert layer.last_dropped_fraction.item() == pytest.approx(dropped / 32)


def test_last_dropped_fraction_hand_worked() -> None:
    # Identity router (H = E = 3), sigmoid scores: 4 tokens, K=2, capacity ceil(8/3 * 0.7) = 2.
    # Expert 0 is chosen by all 4 tokens, expert 1 by 3, expert 2 by 1 -> 2 + 1 = 3 of 8 slots dropped.
    cfg = MoEConfig(
        hidden_size=3,
        ffn_hidden_size=4,
        num_experts=3,
        top_k=2,
        score_func="sigmoid",
        capacity_factor=0.7,
        experts_backend="loop",
        aux_loss="none",
    )
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(3))
    layer(torch.tensor([[0.6, 0.4, -9.0], [0.7, -9.0, 0.3], [0.9, 0.1, -9.0], [0.2, 0.8, -9.0]]))
    assert layer.last_tokens_per_expert.tolist() == [4, 3, 1]
    assert layer.last_dropped_fraction.item() == pytest.approx(3 / 8)


def test_last_dropped_fraction_is_none_when_dropless_and_zero_with_room() -> None:
    dropless = _make_layer()
    dropless(_data()[0])
    assert dropless.last_dropped_fraction is None
    roomy = _make_layer(capacity_factor=4.0)  # capacity = 32 = every slot
    roomy(_data()[0])
    assert roomy.last_dropped_fraction.item() == 0.0


def test_layer_keeps_leading_shape_and_2d_input() -> None:
    layer = _make_layer()
    x = torch.randn(3, 5, 8)
    y3 = layer(x)
    y2 = layer(x.reshape(15, 8))
    assert y3.shape == (3, 5, 8) and y2.shape == (15, 8)
    torch.testing.assert_close(y3.reshape(15, 8), y2, atol=0, rtol=0)


# ---- errors -------------------------------------------------------------------------------------


def test_layer_rejects_wrong_hidden_size_at_forward() -> None:
    layer = _make_layer()
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp: input has hidden size 6.*hidden_size=8"):
        layer(torch.randn(4, 6))


@pytest.mark.parametrize("where", ["input", "router_weight"])
def test_non_finite_router_logits_raise_naming_the_layer_when_check_finite(where: str) -> None:
    layer = _make_layer(check_finite=True)
    x = torch.randn(4, 8)
    if where == "input":
        x[2, 3] = float("nan")
    else:
        with torch.no_grad():
            layer.router.weight[1, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"blocks\.0\.mlp: router logits are not finite"):
        layer(x)


def test_non_finite_input_without_check_finite_does_not_raise() -> None:
    layer = _make_layer(check_finite=False)
    x = torch.randn(4, 8)
    x[2, 3] = float("nan")
    y = layer(x)
    assert torch.isfinite(y[[0, 1, 3]]).all()  # other tokens are untouched


# ---- helpers over a model -----------------------------------------------------------------------


def test_update_expert_biases_steps_every_layer_and_resets_counts() -> None:
    cfg = dict(expert_bias=True, bias_update_rate=0.1)
    model = nn.Sequential(_make_layer(**cfg), nn.Identity(), _make_layer(seed=1, **cfg))
    assert [name for name, _ in find_moe_layers(model)] == ["0", "2"]
    # Forced routes: layer 0 counts (3, 2, 1, 0), mean 1.5 -> sign (-, -, +, +);
    #                layer 2 counts (1, 1, 1, 3), mean 1.5 -> sign (-, -, -, +).
    forced = {0: torch.tensor([[0, 1], [0, 1], [0, 2]]), 2: torch.tensor([[3, 2], [3, 1], [3, 0]])}
    for i, ids in forced.items():
        model[i].router.set_routing_override(lambda computed, ids=ids: ids)
    model(torch.randn(3, 8))
    assert model[0].router.tokens_per_expert_since_update.tolist() == [3.0, 2.0, 1.0, 0.0]
    assert model[2].router.tokens_per_expert_since_update.tolist() == [1.0, 1.0, 1.0, 3.0]

    update_expert_biases(model)
    torch.testing.assert_close(model[0].router.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    torch.testing.assert_close(model[2].router.expert_bias, torch.tensor([0.1, 0.1, 0.1, -0.1]))
    for i in forced:
        assert model[i].router.tokens_per_expert_since_update.tolist() == [0.0] * 4

    update_expert_biases(model)  # nothing counted since: mean - c = 0 everywhere, bias unchanged
    torch.testing.assert_close(model[0].router.expert_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))


@pytest.mark.parametrize("lean", [False, True, "rebuild_x", "rebuild_a"])
def test_fused_local_path_matches_generic_dispatch_path(lean: bool | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused permute→experts→combine node (keeping or rebuilding x_RH / a_RF) equals the stages."""
    if isinstance(lean, str):  # the automatic choice, forced to rebuild one of the two
        import lightning_moe.ops.local_experts as local_ops

        monkeypatch.setattr(local_ops, "rebuild_is_cheap", lambda h, f: (lean == "rebuild_x", lean == "rebuild_a"))
        lean = None  # type: ignore[assignment]
    torch.manual_seed(3)
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=6, top_k=2, pre_softmax=True, aux_loss="none")
    fused, generic = MoELayer(cfg), MoELayer(cfg)
    generic.load_state_dict(fused.state_dict())
    fused.experts.lean_backward = lean
    generic.dispatcher.capabilities = replace(generic.dispatcher.capabilities, runs_experts=False)  # generic stages
    x = torch.randn(3, 7, 8)
    outs = []
    for layer in (fused, generic):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(torch.ones_like(y) * torch.arange(8.0))
        outs.append((y.detach(), xi.grad, [p.grad.clone() for p in layer.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[0][2], outs[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_router_entropy_is_recorded_only_when_asked() -> None:
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, pre_softmax=True)
    layer = MoELayer(cfg)
    layer(torch.randn(5, 8))
    assert layer.last_router_entropy is None
    layer.record_router_entropy = True
    layer(torch.randn(5, 8))
    assert layer.last_router_entropy is not None and 0 < float(layer.last_router_entropy) <= math.log(4) + 1e-6


def test_automatic_rebuild_choice_keeps_fine_grained_and_rebuilds_wide_experts() -> None:
    from lightning_moe.ops.local_experts import rebuild_is_cheap

    assert rebuild_is_cheap(2048, 768) == (False, False)  # qwen3-30b-a3b: 6 % and 3 % of its GEMMs
    assert rebuild_is_cheap(7168, 2048) == (True, True)  # deepseek-v3
    assert rebuild_is_cheap(4096, 14336) == (True, True)  # mixtral-8x7b
    assert MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)).experts.lean_backward is None


def test_routing_weights_are_built_after_the_first_expert_gemm_is_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's path to the first expert GEMM is step time while the device waits for it: the
    routing weights (softmax, gather, normalise), the row weights and the per-expert counts are
    built after that launch, and the result is the same as building them first."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import lightning_moe.ops.local_experts as local_ops
    from lightning_moe import MoEConfig, MoELayer

    events: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            events.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    original_gmm = local_ops.gmm

    def marked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append("FIRST_GEMM" if "FIRST_GEMM" not in events else "gemm")
        return original_gmm(*args, **kwargs)

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, pre_softmax=True, aux_loss="none")
    layer = MoELayer(cfg)
    x = torch.randn(6, 16)
    want = layer(x)
    monkeypatch.setattr(local_ops, "gmm", marked)
    with Log():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    first = events.index("FIRST_GEMM")
    before, after = events[:first], events[first:]
    for op in ("gather", "div"):  # routing weights: gather the chosen scores, normalise
        assert op not in before and op in after, (op, before)
    # On CPU the reference permutation counts per expert itself (one scatter-add); the router's
    # own count (RouterOutput.tokens_per_expert_E) comes after the GEMM, when the layer records it.
    assert before.count("scatter_add_") == 1 and "scatter_add_" in after, before
    assert layer.last_tokens_per_expert.sum().item() == 6 * 2  # counted all the same, after


def test_automatic_rebuild_choice_decides_each_buffer_by_its_own_cost() -> None:
    """Re-gathering x_RH costs 4H*200 / (18HF) of the GEMMs (cheap when F > 1778), recomputing
    a_RF 6F*200 / (18HF) (cheap when H > 2667): shapes where only one is cheap tell them apart."""
    from lightning_moe.ops.local_experts import rebuild_is_cheap

    assert rebuild_is_cheap(2048, 2048) == (True, False)  # x: 800/36864 = 2.2 %; a: 1200/36864 = 3.3 %
    assert rebuild_is_cheap(4096, 1024) == (False, True)  # x: 800/18432 = 4.3 %; a: 1200/73728 = 1.6 %


def test_frozen_experts_still_pass_the_routing_weights_gradient_to_the_router() -> None:
    """Experts frozen (router-only fine-tuning): the router weight and x still get the gradient
    through the combine weights, equal to the dense per-token reference's."""
    layer = _make_layer()
    layer.experts.w13.requires_grad_(False)
    layer.experts.w2.requires_grad_(False)
    x, g = _data()
    got = _forward_backward(layer, layer, x, g)
    expected = _forward_backward(lambda x: dense_reference(layer, x), layer, x, g)
    assert set(got[2]) == {"router.weight"}
    _assert_same(got, expected)
