"""Dispatchers declare what they offer beyond dispatch / combine, and the layer reads only that."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from lightning_moe.config import MoEConfig
from lightning_moe.moe import DispatcherCapabilities, LocalDispatcher, MoELayer
from lightning_moe.moe.dispatch import (
    NO_EXTRAS,
    AllGatherDispatcher,
    AllToAllDispatcher,
    AllToAllTokenExchange,
    DeepEPExchange,
    EchoDispatcher,
    FlexDispatcher,
    HybridEPExchange,
)


def test_local_dispatcher_runs_experts_and_takes_the_router_permutation_only_when_dropless() -> None:
    dropless, dropping = LocalDispatcher(4, dropless=True), LocalDispatcher(4, dropless=False)
    assert dropless.capabilities == DispatcherCapabilities(
        runs_experts=True, takes_router_permutation=True, rows_cheap_to_rebuild=True, carries_fp8_rows=True
    )
    assert dropping.capabilities == DispatcherCapabilities(
        runs_experts=True, takes_router_permutation=False, rows_cheap_to_rebuild=True, carries_fp8_rows=True
    )
    assert dropless.ep_size == 1


@pytest.mark.parametrize("cls", [AllToAllDispatcher, AllGatherDispatcher, FlexDispatcher, EchoDispatcher])
def test_expert_parallel_dispatchers_offer_nothing_beyond_dispatch_and_combine(cls: type) -> None:
    # beyond FP8 rows, which the all-to-all carries (tests/unit/test_fp8_dispatch.py)
    assert cls.capabilities == NO_EXTRAS or cls.capabilities == DispatcherCapabilities(carries_fp8_rows=True)
    assert not (NO_EXTRAS.runs_experts or NO_EXTRAS.takes_router_permutation or NO_EXTRAS.rows_cheap_to_rebuild)


def test_capabilities_are_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        NO_EXTRAS.runs_experts = True  # type: ignore[misc]


def test_only_the_dedup_all_to_all_exchange_takes_any_expert_count() -> None:
    assert AllToAllTokenExchange.takes_any_expert_count
    assert not DeepEPExchange.takes_any_expert_count
    assert not HybridEPExchange.takes_any_expert_count


class _NoFusedCall(LocalDispatcher):
    """Has ``run_experts`` but declares it does not: the layer must take the three stages."""

    def run_experts(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("run_experts called although capabilities.runs_experts is False")


def test_layer_takes_the_three_stages_when_the_dispatcher_declares_no_fused_call() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, aux_loss="none")
    layer, reference = MoELayer(cfg), MoELayer(cfg)
    reference.load_state_dict(layer.state_dict())
    layer.dispatcher = _NoFusedCall(4, dropless=True)
    layer.dispatcher.capabilities = replace(layer.dispatcher.capabilities, runs_experts=False)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-6)


def test_layer_asks_the_router_for_its_permutation_only_when_the_dispatcher_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, aux_loss="none")
    layer = MoELayer(cfg)
    assert layer.dispatcher.capabilities.takes_router_permutation  # dropless local: the fused router call
    calls: list[int] = []
    original = layer.router.route_and_permute
    monkeypatch.setattr(layer.router, "route_and_permute", lambda x: calls.append(1) or original(x))
    x = torch.randn(2, 5, 8)
    expected = layer(x)
    assert calls == [1]
    layer.dispatcher.capabilities = replace(layer.dispatcher.capabilities, takes_router_permutation=False)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    assert calls == [1]


@pytest.mark.parametrize("cheap", [True, False])
def test_moe_act_recompute_stands_in_only_for_dispatchers_whose_rows_are_cheap_to_rebuild(cheap: bool) -> None:
    from lightning_moe.models.recompute import RecomputePlan, RecomputeScope

    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, aux_loss="none")
    layer = MoELayer(cfg)
    layer.dispatcher.capabilities = replace(layer.dispatcher.capabilities, rows_cheap_to_rebuild=cheap)
    seen: list[type] = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(type(module.dispatcher)))
    x = torch.randn(2, 5, 8, requires_grad=True)
    with RecomputeScope(RecomputePlan(moe_act=True)) as scope:
        scope.ffn(layer, x).sum().backward()
    assert (seen[0] is not LocalDispatcher) is cheap  # the moe_act stand-in replaces it for the forward
    assert type(layer.dispatcher) is LocalDispatcher  # and is gone afterwards
