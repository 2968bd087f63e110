"""ECHOExpertCloning on one process: argument checks, refusal without MoE layers, and a no-op
(with one warning) when the layers are not expert-parallel. The cloning itself needs an EP
group: ``tests/dist/test_echo.py`` (4 gloo ranks) checks loss/parameter equality, the load
balance and checkpoint resume; ``test_echo_plan.py`` checks the planner.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _callback_models import tiny_config, tiny_trainer, token_loader
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_moe.callbacks import ECHOExpertCloning
from lightning_moe.lit import MoELanguageModel
from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.dispatch_echo import EchoDispatcher
from lightning_moe.moe.dispatch_flex import FlexDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.utils import find_moe_layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spare_slots_per_rank": 0}, "spare_slots_per_rank=0 must be >= 1"),
        ({"interval": 0}, "interval=0 must be >= 1"),
        ({"tolerance": -1.0}, "tolerance=-1.0 must be >= 0"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ECHOExpertCloning(**kwargs)


def test_model_without_moe_layer_is_refused_with_the_fix(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, [ECHOExpertCloning()], max_steps=1)
    with pytest.raises(ValueError, match=r"ECHOExpertCloning: BoringModel holds no .*MoELayer.*swap_moe_blocks"):
        trainer.fit(BoringModel())


def test_without_expert_parallelism_it_warns_once_and_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MoELanguageModel(tiny_config(), warmup_steps=1)
    echo = ECHOExpertCloning(spare_slots_per_rank=2)
    with pytest.warns(UserWarning, match=r"not expert-parallel \(ep=1\).*folded_moe"):
        tiny_trainer(tmp_path, [echo], max_steps=2).fit(model, train_dataloaders=token_loader())
    assert all(type(layer.dispatcher) is LocalDispatcher for _, layer in find_moe_layers(model))
    assert echo.active_clones == [] and echo.plans_made == 0


def test_echo_dispatcher_refuses_expert_tensor_parallel_and_sharded_experts() -> None:
    experts = GroupedExperts(8, 16, 8, backend="loop")
    with pytest.raises(NotImplementedError, match=r"etp > 1.*set etp=1"):
        EchoDispatcher(SimpleNamespace(etp_group=object()), experts, 1)  # type: ignore[arg-type]
    base = SimpleNamespace(
        etp_group=None, num_experts=8, num_local_experts=4, ep_group=None, ep_size=2, ep_rank=0
    )  # all 8 experts held locally, but the dispatcher says 4 are local: not the layout ECHO needs
    with pytest.raises(NotImplementedError, match=r"shapes \(8, 16, 16\).*expected \(4, 16, 16\).*edp=1"):
        EchoDispatcher(base, experts, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spare_slots=0 must be >= 1"):
        EchoDispatcher(SimpleNamespace(etp_group=None), experts, 0)  # type: ignore[arg-type]


class _TwoRanks:
    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def test_echo_dispatcher_refuses_a_flex_exchange_that_cannot_carry_clones() -> None:
    """A library buffer sized for one expert count (Hybrid-EP) or untested with clones (DeepEP)."""
    experts = GroupedExperts(4, 16, 8, backend="loop")  # this rank's 4 of 8 experts
    for name in ("deepep", "hybridep"):
        exchange = SimpleNamespace(name=name, needs_bf16=True)
        base = FlexDispatcher(8, ep_group=_TwoRanks(), exchange=exchange)  # type: ignore[arg-type]
        with pytest.raises(NotImplementedError, match=rf"\({name}\) cannot carry clones.*dispatcher='alltoall'"):
            EchoDispatcher(base, experts, 1)
