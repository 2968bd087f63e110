"""TopKRouter: score functions, group-limited top-k, expert bias, capacity drops, bias update.

Routing is checked against a per-token Python loop written here (the independent spec), on
random logits (continuous, so no ties) and on hand-worked cases.

Legend: T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.config import MoEConfig
from lightning_moe.moe.router import TopKRouter, drop_over_capacity, expert_capacity

WEIGHT_ATOL = 1e-6  # fp32 softmax / sigmoid of O(1) logits vs a float64 Python loop


# ---- independent spec ----------------------------------------------------------------------------


def route_token(logits: list[float], cfg: MoEConfig, bias: list[float] | None = None) -> tuple[list[int], list[float]]:
    """One token, plain Python floats: (ids in descending selection score, weights)."""
    E, K = len(logits), cfg.top_k
    if cfg.score_func == "sigmoid":
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    elif cfg.pre_softmax:
        m = max(logits)
        ex = [math.exp(v - m) for v in logits]
        scores = [v / sum(ex) for v in ex]
    else:
        scores = list(logits)
    select = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]

    allowed = list(range(E))
    if cfg.num_groups is not None:
        size = E // cfg.num_groups
        per_group = K // cfg.group_topk
        group_score = [
            sum(sorted(select[g * size : (g + 1) * size], reverse=True)[:per_group]) for g in range(cfg.num_groups)
        ]
        kept = sorted(range(cfg.num_groups), key=lambda g: -group_score[g])[: cfg.group_topk]
        allowed = [i for i in range(E) if i // size in kept]
    ids = sorted(allowed, key=lambda i: -select[i])[:K]

    if cfg.score_func == "softmax" and not cfg.pre_softmax:
        m = max(logits[i] for i in ids)
        ex = [math.exp(logits[i] - m) for i in ids]
        weights = [v / sum(ex) for v in ex]
    else:
        weights = [scores[i] for i in ids]
        if cfg.norm_topk_prob and K > 1:
            weights = [w / sum(weights) for w in weights]
    if cfg.scaling_factor is not None:
        weights = [w * cfg.scaling_factor for w in weights]
    return ids, weights


def route_reference(logits_TE: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None):
    rows = [route_token(row, cfg, None if bias is None else bias.tolist()) for row in logits_TE.double().tolist()]
    ids = torch.tensor([r[0] for r in rows])
    weights = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    return ids, weights


def _router(cfg: MoEConfig, seed: int = 0) -> TopKRouter:
    torch.manual_seed(seed)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(std=1.0)
    return router


def _identity_router(cfg: MoEConfig) -> TopKRouter:
    """hidden_size == num_experts and weight = I, so the input rows *are* the logits."""
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(cfg.num_experts))
    return router


# ---- score functions vs the per-token loop --------------------------------------------------------

ROUTING_CASES = {
    "softmax_over_topk_logits": dict(score_func="softmax", top_k=2),
    "softmax_over_topk_logits_scaled": dict(score_func="softmax", top_k=3, scaling_factor=2.5),
    "pre_softmax_norm": dict(score_func="softmax", pre_softmax=True, top_k=2, norm_topk_prob=True),
    "pre_softmax_no_norm": dict(score_func="softmax", pre_softmax=True, top_k=2, norm_topk_prob=False),
    "pre_softmax_top1": dict(score_func="softmax", pre_softmax=True, top_k=1),
    "sigmoid_norm": dict(score_func="sigmoid", top_k=2, norm_topk_prob=True),
    "sigmoid_no_norm": dict(score_func="sigmoid", top_k=2, norm_topk_prob=False),
    "sigmoid_norm_scaled": dict(score_func="sigmoid", top_k=4, norm_topk_prob=True, scaling_factor=2.5),
    "sigmoid_top1_norm_is_noop": dict(score_func="sigmoid", top_k=1, norm_topk_prob=True),
    "group_limited_sigmoid": dict(score_func="sigmoid", top_k=4, num_groups=4, group_topk=2, scaling_factor=2.5),
    "group_limited_pre_softmax": dict(score_func="softmax", pre_softmax=True, top_k=2, num_groups=4, group_topk=2),
    "group_limited_one_group": dict(score_func="sigmoid", top_k=3, num_groups=2, group_topk=1),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_router_matches_per_token_loop(case: str) -> None:
    cfg = MoEConfig(hidden_size=6, ffn_hidden_size=4, num_experts=8, **ROUTING_CASES[case])
    router = _router(cfg, seed=1)
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(2))
    out = router(x)

    torch.testing.assert_close(out.logits_TE, x @ router.weight.detach().T, atol=1e-6, rtol=1e-6)
    ids_ref, weights_ref = route_reference(out.logits_TE.detach(), cfg)
    assert torch.equal(out.topk_ids_TK, ids_ref)
    assert torch.equal(out.routed_ids_TK, ids_ref)  # dropless: nothing dropped
    torch.testing.assert_close(out.topk_weights_TK.double(), weights_ref, atol=WEIGHT_ATOL, rtol=0)
    assert torch.equal(out.tokens_per_expert_E, torch.bincount(ids_ref.reshape(-1), minlength=8))


@pytest.mark.parametrize(
    "case", ["group_limited_sigmoid", "sigmoid_norm", "pre_softmax_norm", "softmax_over_topk_logits"]
)
def test_router_with_expert_bias_matches_per_token_loop(case: str) -> None:
    cfg = MoEConfig(hidden_size=6, ffn_hidden_size=4, num_experts=8, expert_bias=True, **ROUTING_CASES[case])
    router = _router(cfg, seed=3)
    bias = torch.linspace(-0.4, 0.4, 8)[torch.randperm(8, generator=torch.Generator().manual_seed(0))]
    router.expert_bias.copy_(bias)
    out = router(torch.randn(32, 6, generator=torch.Generator().manual_seed(4)))
    ids_ref, weights_ref = route_reference(out.logits_TE.detach(), cfg, bias)
    assert torch.equal(out.topk_ids_TK, ids_ref)
    torch.testing.assert_close(out.topk_weights_TK.double(), weights_ref, atol=WEIGHT_ATOL, rtol=0)


def test_group_limited_topk_hand_worked() -> None:
    # E=8 in G=4 groups of 2, group_topk=2, K=4, so each group scores with its top-2 sum.
    # Group sums: g0 = 0.95+0.05 = 1.00 (holds the single best expert), g1 = 0.7+0.6 = 1.3,
    # g2 = 0.5+0.55 = 1.05, g3 = 0.1+0.2 = 0.3 -> keep g1, g2; the best expert 0 is excluded.
    cfg = MoEConfig(
        hidden_size=8,
        ffn_hidden_size=4,
        num_experts=8,
        top_k=4,
        score_func="sigmoid",
        norm_topk_prob=False,
        num_groups=4,
        group_topk=2,
    )
    probs = torch.tensor([[0.95, 0.05, 0.7, 0.6, 0.5, 0.55, 0.1, 0.2]])
    out = _identity_router(cfg)(torch.logit(probs.double()).float())
    assert out.topk_ids_TK.tolist() == [[2, 3, 5, 4]]
    torch.testing.assert_close(out.topk_weights_TK, torch.tensor([[0.7, 0.6, 0.55, 0.5]]), atol=1e-6, rtol=0)


def test_softmax_over_topk_logits_hand_worked() -> None:
    # logits (0, ln 3, -5, ln 1) -> top-2 = experts 1, 0 -> softmax(ln 3, 0) = (3/4, 1/4).
    cfg = MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, scaling_factor=2.0)
    out = _identity_router(cfg)(torch.tensor([[0.0, math.log(3.0), -5.0, -1.0]]))
    assert out.topk_ids_TK.tolist() == [[1, 0]]
    torch.testing.assert_close(out.topk_weights_TK, torch.tensor([[1.5, 0.5]]), atol=1e-6, rtol=0)


# ---- expert bias: selection only ------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_expert_bias_changes_selection_but_not_weights(score_func: str) -> None:
    cfg = MoEConfig(
        hidden_size=4,
        ffn_hidden_size=4,
        num_experts=4,
        top_k=2,
        score_func=score_func,
        pre_softmax=score_func == "softmax",
        norm_topk_prob=False,
        expert_bias=True,
    )
    router = _identity_router(cfg)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    unbiased = router(logits)
    assert unbiased.topk_ids_TK.tolist() == [[0, 1]]

    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # expert 3 jumps to the front
    biased = router(logits)
    assert biased.topk_ids_TK.tolist() == [[3, 0]]
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    # Weights are the *unbiased* scores at the chosen ids (bias 5.0 is nowhere in them).
    torch.testing.assert_close(biased.topk_weights_TK, scores[:, [3, 0]], atol=1e-7, rtol=0)


# ---- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["softmax_over_topk_logits_scaled", "pre_softmax_norm", "sigmoid_norm", "sigmoid_no_norm"]
)
def test_router_weight_gets_gradient_of_routing_weights(case: str) -> None:
    cfg = MoEConfig(hidden_size=6, ffn_hidden_size=4, num_experts=8, **ROUTING_CASES[case])
    router = _router(cfg, seed=5)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(6))
    g = torch.randn(16, cfg.top_k, generator=torch.Generator().manual_seed(7))
    out = router(x)
    (out.topk_weights_TK * g).sum().backward()

    # Independent differentiable spec, per token, at the ids the loop picks.
    W = router.weight.detach().clone().requires_grad_(True)
    ids_ref, _ = route_reference((x @ W.T).detach(), cfg)
    total = 0.0
    for t in range(16):
        logits = W @ x[t]
        chosen = logits[ids_ref[t]]
        if cfg.score_func == "softmax" and not cfg.pre_softmax:
            w = torch.softmax(chosen, 0)
        else:
            all_scores = torch.softmax(logits, 0) if cfg.score_func == "softmax" else torch.sigmoid(logits)
            w = all_scores[ids_ref[t]]
            if cfg.norm_topk_prob and cfg.top_k > 1:
                w = w / w.sum()
        if cfg.scaling_factor is not None:
            w = w * cfg.scaling_factor
        total = total + (w * g[t]).sum()
    total.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(router.weight.grad, W.grad, atol=1e-6, rtol=1e-5)


def test_routing_override_replays_ids_and_regathers_live_weights() -> None:
    cfg = MoEConfig(
        hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, score_func="sigmoid", norm_topk_prob=False
    )
    router = _identity_router(cfg)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.3, -0.2, 0.1]])
    forced = torch.tensor([[3, 2], [0, 2]])
    router.set_routing_override(lambda computed: forced)
    out = router(logits)
    assert out.topk_ids_TK.tolist() == forced.tolist()
    torch.testing.assert_close(out.topk_weights_TK, torch.sigmoid(logits).gather(1, forced), atol=1e-7, rtol=0)
    router.set_routing_override(None)
    assert router(logits).topk_ids_TK.tolist() == [[0, 1], [1, 3]]


@pytest.mark.parametrize(
    ("forced", "match"),
    [(torch.tensor([[0, 1, 2]]), r"shape \(1, 3\), expected \(1, 2\)"), (torch.tensor([[0, 4]]), r"\[0, 4\)")],
)
def test_routing_override_with_bad_ids_raises(forced: torch.Tensor, match: str) -> None:
    cfg = MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2)
    router = _identity_router(cfg)
    router.set_routing_override(lambda computed: forced)
    with pytest.raises(ValueError, match=match):
        router(torch.zeros(1, 4))


# ---- capacity --------------------------------------------------------------------------------------

# 4 tokens, K=2, E=3, capacity 2. Slots per expert (token, slot, weight):
#   expert 0: (t0,k0,.6) (t1,k0,.7) (t2,k0,.9) (t3,k1,.2)
#   expert 1: (t0,k1,.4) (t2,k1,.1) (t3,k0,.8)
#   expert 2: (t1,k1,.3)
CAP_IDS = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
CAP_WEIGHTS = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.8, 0.2]])
# probs keeps the two highest weights per expert: expert 0 keeps t2 (.9), t1 (.7); expert 1 keeps t3 (.8), t0 (.4).
PROBS_IDS = [[-1, 1], [0, 2], [0, -1], [1, -1]]
PROBS_WEIGHTS = [[0.0, 0.4], [0.7, 0.3], [0.9, 0.0], [0.8, 0.0]]
# position keeps the two earliest tokens per expert: expert 0 keeps t0, t1; expert 1 keeps t0, t2.
POSITION_IDS = [[0, 1], [0, 2], [-1, 1], [-1, -1]]
POSITION_WEIGHTS = [[0.6, 0.4], [0.7, 0.3], [0.0, 0.1], [0.0, 0.0]]


@pytest.mark.parametrize(
    ("policy", "ids", "weights"),
    [("probs", PROBS_IDS, PROBS_WEIGHTS), ("position", POSITION_IDS, POSITION_WEIGHTS)],
)
def test_drop_over_capacity_hand_worked(policy: str, ids: list, weights: list) -> None:
    kept_ids, kept_weights = drop_over_capacity(CAP_IDS, CAP_WEIGHTS, num_experts=3, capacity=2, policy=policy)
    assert kept_ids.tolist() == ids
    torch.testing.assert_close(kept_weights, torch.tensor(weights), atol=0, rtol=0)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_drop_over_capacity_with_room_for_all_keeps_everything(policy: str) -> None:
    kept_ids, kept_weights = drop_over_capacity(CAP_IDS, CAP_WEIGHTS, num_experts=3, capacity=4, policy=policy)
    assert torch.equal(kept_ids, CAP_IDS) and torch.equal(kept_weights, CAP_WEIGHTS)


@pytest.mark.parametrize(
    ("policy", "ids", "weights"),
    [("probs", PROBS_IDS, PROBS_WEIGHTS), ("position", POSITION_IDS, POSITION_WEIGHTS)],
)
def test_router_capacity_drops_slots_by_policy(policy: str, ids: list, weights: list) -> None:
    # Identity router, sigmoid without norm: weights = sigmoid(logit), monotone in the logit, so
    # logits = logit(CAP_WEIGHTS) at the chosen ids (and a very low logit elsewhere) reproduce the
    # hand-worked case above. capacity = ceil(4*2/3 * 0.7) = ceil(1.87) = 2.
    cfg = MoEConfig(
        hidden_size=3,
        ffn_hidden_size=4,
        num_experts=3,
        top_k=2,
        score_func="sigmoid",
        norm_topk_prob=False,
        capacity_factor=0.7,
        drop_policy=policy,
    )
    assert expert_capacity(4, 2, 3, 0.7) == 2
    logits = torch.full((4, 3), -20.0).scatter(1, CAP_IDS, torch.logit(CAP_WEIGHTS))
    out = _identity_router(cfg)(logits)
    assert out.topk_ids_TK.tolist() == ids
    assert out.routed_ids_TK.tolist() == CAP_IDS.tolist()  # before drops
    assert out.tokens_per_expert_E.tolist() == [4, 3, 1]  # routed, before drops
    torch.testing.assert_close(out.topk_weights_TK, torch.tensor(weights), atol=1e-6, rtol=0)


def test_expert_capacity_is_ceil_of_tokens_times_k_over_e_times_factor() -> None:
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 2, 4, 1.25) == 7  # 6.25 -> 7
    assert expert_capacity(3, 1, 8, 1.0) == 1  # 0.375 -> 1


# ---- aux-loss-free bias update ---------------------------------------------------------------------


def test_expert_bias_update_steps_by_sign_of_mean_minus_count_and_resets_counts() -> None:
    # Two training forwards route tokens to experts (0,1), (0,1), (0,2), then (0,3), (1,2), (0,1):
    # counts c = (5, 4, 2, 1), mean 3 -> sign(3 - c) = (-1, -1, +1, +1).
    cfg = MoEConfig(
        hidden_size=4,
        ffn_hidden_size=4,
        num_experts=4,
        top_k=2,
        score_func="sigmoid",
        expert_bias=True,
        bias_update_rate=0.01,
    )
    router = _identity_router(cfg)
    router.expert_bias.copy_(torch.tensor([0.1, 0.0, 0.0, -0.2]))
    first = torch.tensor([[3.0, 2.0, 0.0, -3.0], [3.0, 2.0, 0.0, -3.0], [3.0, 0.0, 2.0, -3.0]])
    second = torch.tensor([[3.0, 0.0, -3.0, 2.0], [0.0, 3.0, 2.0, -3.0], [3.0, 2.0, 0.0, -3.0]])
    router.train()
    router(first)
    router(second)
    router.eval()
    router(first)  # eval forwards do not count
    assert router.tokens_per_expert_since_update.tolist() == [5.0, 4.0, 2.0, 1.0]

    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.09, -0.01, 0.01, -0.19]), atol=1e-7, rtol=0)
    assert router.tokens_per_expert_since_update.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_expert_bias_update_with_balanced_counts_leaves_bias() -> None:
    cfg = MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, score_func="sigmoid", expert_bias=True)
    router = _identity_router(cfg)
    router.tokens_per_expert_since_update.fill_(3.0)
    router.update_expert_bias()
    assert router.expert_bias.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_router_without_expert_bias_has_no_bias_buffers() -> None:
    router = TopKRouter(MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2))
    assert router.expert_bias is None
    assert set(dict(router.named_buffers())) == set()
    router.update_expert_bias()  # a no-op, not an error


def test_routing_override_with_a_negative_id_raises() -> None:
    """-1 means "dropped by capacity" downstream, so a replayed -1 would silently route nowhere."""
    cfg = MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2)
    router = _identity_router(cfg)
    router.set_routing_override(lambda computed: torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        router(torch.zeros(1, 4))
