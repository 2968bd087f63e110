"""Router aux losses (switch, sequence, global, z-loss) on hand-computed values, and the
AuxLossScaler path that puts them into the backward of ``MoELayer``'s output.

Legend: T tokens, E experts, K experts per token, B sequences of S tokens.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_moe.config import MoEConfig
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.losses import (
    AuxLossScaler,
    aux_probs,
    load_balancing_loss,
    sequence_load_balancing_loss,
    z_loss,
)
from lightning_moe.moe.utils import reset_global_aux_counts, set_aux_loss_scale

# Four tokens, E=4, K=2. Rows are router probabilities p_{t,i} (logits = log p reproduce them).
P = torch.tensor(
    [
        [0.5, 0.25, 0.125, 0.125],  # t0 -> top-2 experts 0, 1
        [0.25, 0.5, 0.125, 0.125],  # t1 -> 1, 0
        [0.125, 0.125, 0.5, 0.25],  # t2 -> 2, 3
        [0.5, 0.125, 0.25, 0.125],  # t3 -> 0, 2
    ]
)
TOPK_IDS = torch.tensor([[0, 1], [1, 0], [2, 3], [0, 2]])
COUNTS = torch.tensor([3, 2, 2, 1])  # c_i
COEFF = 0.1
# sum_t p = (1.375, 1.0, 1.0, 0.625); sum_i c_i sum_t p = 4.125 + 2 + 2 + 0.625 = 8.75
# L = coeff * E / (K * T^2) * 8.75 = 0.1 * 4 / 32 * 8.75
SWITCH_LOSS = 0.109375
# seq 0 = (t0, t1): sum_t p = (.75, .75, .25, .25), c = (2, 2, 0, 0) -> 3.0   -> 0.1 * 4/(2*4) * 3.0 = 0.15
# seq 1 = (t2, t3): sum_t p = (.625, .25, .75, .375), c = (1, 0, 2, 1) -> 2.5 -> 0.1 * 4/(2*4) * 2.5 = 0.125
SEQ_LOSS = (0.15 + 0.125) / 2
# z-loss on logits rows (0, ln 3), (ln 5, ln 5), (0, 0): logsumexp = ln 4, ln 10, ln 2
Z_LOGITS = torch.tensor([[0.0, math.log(3.0)], [math.log(5.0), math.log(5.0)], [0.0, 0.0]])
Z_COEFF = 0.01
Z_LOSS = 0.025680543933564687  # 0.01 * (ln4^2 + ln10^2 + ln2^2) / 3 = 0.01 * (1.921812 + 5.301898 + 0.480453) / 3


def test_switch_loss_hand_computed() -> None:
    loss = load_balancing_loss(P, COUNTS, num_counted_tokens=4, top_k=2, coeff=COEFF)
    assert loss.item() == pytest.approx(SWITCH_LOSS, abs=1e-7)


def test_switch_loss_equals_coeff_for_uniform_load() -> None:
    probs = torch.full((8, 4), 0.25)
    counts = torch.full((4,), 4)  # 8 tokens * K=2 / 4 experts
    assert load_balancing_loss(probs, counts, 8, 2, 0.3).item() == pytest.approx(0.3, abs=1e-7)


def test_switch_loss_gradient_flows_through_probs_only() -> None:
    probs = P.clone().requires_grad_(True)
    counts = COUNTS.float().requires_grad_(True)
    load_balancing_loss(probs, counts, 4, 2, COEFF).backward()
    # d/dp_{t,i} = coeff * E/(K*T^2) * c_i = 0.1 * 4/32 * c_i, the same for every token
    expected = (0.0125 * COUNTS.float()).expand(4, 4)
    torch.testing.assert_close(probs.grad, expected, atol=1e-8, rtol=0)
    assert counts.grad is None or torch.count_nonzero(counts.grad) == 0


def test_sequence_loss_is_per_sequence_mean_hand_computed() -> None:
    loss = sequence_load_balancing_loss(P.view(2, 2, 4), TOPK_IDS.view(2, 2, 2), top_k=2, coeff=COEFF)
    assert loss.item() == pytest.approx(SEQ_LOSS, abs=1e-7)


def test_sequence_loss_ignores_dropped_slots() -> None:
    ids = TOPK_IDS.clone()
    ids[3, 1] = -1  # seq 1 loses its count on expert 2: c = (1, 0, 1, 1) -> .625 + .75 + .375 = 1.75
    loss = sequence_load_balancing_loss(P.view(2, 2, 4), ids.view(2, 2, 2), top_k=2, coeff=COEFF)
    assert loss.item() == pytest.approx((0.15 + 0.05 * 1.75) / 2, abs=1e-7)


def test_z_loss_hand_computed() -> None:
    assert z_loss(Z_LOGITS, Z_COEFF).item() == pytest.approx(Z_LOSS, abs=1e-7)


def test_aux_probs_softmax_and_normalised_sigmoid() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    torch.testing.assert_close(aux_probs(logits, "softmax"), torch.tensor([[0.25, 0.75]]))
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75 -> normalised (0.4, 0.6)
    torch.testing.assert_close(aux_probs(logits, "sigmoid"), torch.tensor([[0.4, 0.6]]))


# ---- through MoELayer -----------------------------------------------------------------------------


def _layer(**overrides) -> MoELayer:
    """E = H = 4 with router weight I, so the input rows are the router logits."""
    cfg = dict(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, aux_loss_coeff=COEFF)
    cfg.update(overrides)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**cfg))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    return layer.train()


def test_layer_switch_loss_hand_computed() -> None:
    layer = _layer(aux_loss="switch")
    layer(P.log())
    assert set(layer.last_aux_losses) == {"load_balancing_loss"}
    assert layer.last_aux_losses["load_balancing_loss"].item() == pytest.approx(SWITCH_LOSS, abs=1e-6)
    assert layer.last_tokens_per_expert.tolist() == COUNTS.tolist()


def test_layer_seq_loss_uses_batch_dim_as_sequences() -> None:
    layer = _layer(aux_loss="seq")
    layer(P.log().view(2, 2, 4))
    assert layer.last_aux_losses["seq_load_balancing_loss"].item() == pytest.approx(SEQ_LOSS, abs=1e-6)


def test_layer_global_loss_accumulates_counts_over_micro_batches_and_resets() -> None:
    layer = _layer(aux_loss="global")
    layer(P.log())  # micro-batch 1: T=4, c = (3, 2, 2, 1)
    assert layer.last_aux_losses["global_load_balancing_loss"].item() == pytest.approx(SWITCH_LOSS, abs=1e-6)

    q = P[2:]  # micro-batch 2: T=2, c = (1, 0, 2, 1); P_i = mean_t q = (.3125, .125, .375, .1875)
    layer(q.log())
    # counts (4, 2, 4, 2) over 6 tokens: 0.1 * 4/2 * (4*.3125 + 2*.125 + 4*.375 + 2*.1875) / 6 = 0.2 * 3.375 / 6
    assert layer.last_aux_losses["global_load_balancing_loss"].item() == pytest.approx(0.1125, abs=1e-6)
    assert layer.global_tokens_per_expert.tolist() == [4.0, 2.0, 4.0, 2.0]

    reset_global_aux_counts(layer)
    assert layer.global_tokens_per_expert.tolist() == [0.0] * 4 and layer.global_num_tokens.item() == 0
    layer(q.log())  # alone: switch loss of micro-batch 2 = 0.1 * 4/(2*4) * (.625 + 1.5 + .375) = 0.125
    assert layer.last_aux_losses["global_load_balancing_loss"].item() == pytest.approx(0.125, abs=1e-6)


def test_layer_z_loss_hand_computed() -> None:
    layer = _layer(aux_loss="none", z_loss_coeff=Z_COEFF)
    logits = torch.tensor([[0.0, math.log(3.0), -30.0, -30.0], [0.0, 0.0, 0.0, 0.0]])
    layer(logits)
    # logsumexp ~= ln 4 for both rows (the -30 entries add < 1e-12)
    assert layer.last_aux_losses["z_loss"].item() == pytest.approx(Z_COEFF * math.log(4.0) ** 2, abs=1e-7)


def test_layer_records_no_aux_losses_in_eval() -> None:
    layer = _layer(aux_loss="switch", z_loss_coeff=Z_COEFF).eval()
    layer(P.log())
    assert layer.last_aux_losses == {}


# ---- AuxLossScaler --------------------------------------------------------------------------------


def test_aux_loss_scaler_is_identity_forward_and_sends_scale_to_aux() -> None:
    x = torch.randn(3, 2, requires_grad=True)
    a = torch.tensor([1.0, -2.0], requires_grad=True)
    aux = (a**2).sum()
    y = AuxLossScaler.apply(x, aux, 0.25)
    assert torch.equal(y, x)
    (y * 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 2), 3.0))
    torch.testing.assert_close(a.grad, 0.25 * 2 * a.detach())  # scale * d(aux)/da, independent of y's grad


def _independent_aux(x_TH: torch.Tensor, W: torch.Tensor, ids_TK: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """``coeff*E/(K*T^2) * sum_i c_i sum_t p_{t,i} + z_coeff * mean_t lse_t^2`` (counts constant)."""
    T, E, K = x_TH.shape[0], cfg.num_experts, cfg.top_k
    logits = x_TH @ W.T
    p = torch.softmax(logits, -1)
    c = torch.bincount(ids_TK.reshape(-1), minlength=E).float()
    switch = cfg.aux_loss_coeff * E / (K * T * T) * (c * p.sum(0)).sum()
    return switch + cfg.z_loss_coeff * torch.logsumexp(logits, -1).pow(2).mean()


def test_aux_gradient_reaches_router_through_layer_output_scaled_by_aux_loss_scale() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=8,
        ffn_hidden_size=8,
        num_experts=4,
        top_k=2,
        aux_loss="switch",
        aux_loss_coeff=0.5,
        z_loss_coeff=0.05,
    )
    with_aux = MoELayer(cfg).train()
    with torch.no_grad():
        with_aux.router.weight.normal_(std=0.5)
    no_aux = MoELayer(dataclasses.replace(cfg, aux_loss="none", z_loss_coeff=None)).train()
    no_aux.load_state_dict(with_aux.state_dict())
    scale = 0.37
    set_aux_loss_scale(with_aux, scale)
    assert with_aux.aux_loss_scale == scale

    x = torch.randn(2, 6, 8)
    g = torch.randn(2, 6, 8)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1 = with_aux(x1)
    y2 = no_aux(x2)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)  # aux changes nothing in forward
    assert no_aux.last_aux_losses == {}
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()

    W = with_aux.router.weight.detach().clone().requires_grad_(True)
    xa = x.reshape(-1, 8).clone().requires_grad_(True)
    ids = with_aux.router(x.reshape(-1, 8)).routed_ids_TK
    aux = _independent_aux(xa, W, ids, cfg)
    expected_total = with_aux.last_aux_losses["load_balancing_loss"] + with_aux.last_aux_losses["z_loss"]
    assert aux.item() == pytest.approx(expected_total.item(), rel=1e-5)
    d_aux_dW, d_aux_dx = torch.autograd.grad(aux, (W, xa))

    torch.testing.assert_close(
        with_aux.router.weight.grad, no_aux.router.weight.grad + scale * d_aux_dW, atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(x1.grad, x2.grad + scale * d_aux_dx.view_as(x), atol=1e-6, rtol=1e-5)
    # The experts do not see the aux loss.
    torch.testing.assert_close(with_aux.experts.w13.grad, no_aux.experts.w13.grad, atol=0, rtol=0)
    torch.testing.assert_close(with_aux.experts.w2.grad, no_aux.experts.w2.grad, atol=0, rtol=0)
    assert (with_aux.router.weight.grad - no_aux.router.weight.grad).abs().max() > 1e-4  # the term is not negligible
