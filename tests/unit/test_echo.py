"""ECHOExpertCloning on one process: argument checks, refusal without MoE layers, and a no-op
(with one warning) when the layers are not expert-parallel. The cloning itself needs an EP
group: ``tests/dist/test_echo.py`` (4 gloo ranks) checks loss/parameter equality, the load
balance and checkpoint resume; ``test_echo_plan.py`` checks the planner.
"""

from __future__ import annotations

from collections.abc import Callable
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
from lightning_moe.moe.dispatch.echo import EchoDispatcher
from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange
from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange
from lightning_moe.moe.dispatch.flex import FlexDispatcher
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
    for cls in (DeepEPExchange, HybridEPExchange):  # their declared flag, on a stand-in without buffers
        name = cls.name
        exchange = SimpleNamespace(name=name, needs_bf16=True, takes_any_expert_count=cls.takes_any_expert_count)
        base = FlexDispatcher(8, ep_group=_TwoRanks(), exchange=exchange)  # type: ignore[arg-type]
        with pytest.raises(NotImplementedError, match=rf"\({name}\) cannot carry clones.*dispatcher='alltoall'"):
            EchoDispatcher(base, experts, 1)


def test_each_plan_uses_only_the_counts_routed_since_the_previous_plan(
    monkeypatch: pytest.MonkeyPatch, fake_world: Callable[[int, int], None]
) -> None:
    """interval=2, two micro-batches a step: plans at steps 2 and 4, from steps 0-1 and 2-3 alone.

    Rank 0 of a fake 2-rank world (``fake_pg``: collectives move no data, so the all-reduced
    counts are this rank's; the clone weight exchange is recorded instead of run).
    """
    import torch.distributed as dist

    import lightning_moe.callbacks.echo as echo_mod
    from lightning_moe.config import MoEConfig
    from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
    from lightning_moe.moe.layer import MoELayer

    fake_world(0, 2)
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2))
    layer.experts = GroupedExperts(2, 8, 4, backend="loop")  # this rank's 2 of 4 experts
    layer.dispatcher = AllToAllDispatcher(4, ep_group=dist.group.WORLD)

    class Holder(torch.nn.Module):
        device = torch.device("cpu")

        def __init__(self) -> None:
            super().__init__()
            self.moe = layer

    holder = Holder()
    seen: list[torch.Tensor] = []
    real_plan = echo_mod.plan_clones
    monkeypatch.setattr(echo_mod, "plan_clones", lambda c, *a: (seen.append(c.clone()), real_plan(c, *a))[1])
    refreshed: list[int] = []
    monkeypatch.setattr(EchoDispatcher, "refresh_clones", lambda self: refreshed.append(trainer.global_step))
    cb = ECHOExpertCloning(spare_slots_per_rank=1, interval=2)
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(), precision_plugin=SimpleNamespace())
    cb.on_train_start(trainer, holder)  # type: ignore[arg-type]
    per_step = [torch.tensor(c, dtype=torch.float64) for c in ([8, 0, 0, 0], [0, 8, 0, 0], [0, 0, 8, 0], [0, 0, 0, 8])]
    for step in range(5):
        trainer.global_step = step
        for micro in range(2):
            cb.on_train_batch_start(trainer, holder, None, 2 * step + micro)  # type: ignore[arg-type]
            layer.last_tokens_per_expert = per_step[step % 4]
            cb.on_train_batch_end(trainer, holder, None, None, 2 * step + micro)  # type: ignore[arg-type]
    cb.on_train_end(trainer, holder)  # type: ignore[arg-type]
    assert cb.plans_made == 2 and len(seen) == 2
    assert refreshed == [0, 1, 2, 3, 4]  # once per optimizer step, not per micro-batch
    torch.testing.assert_close(seen[0], torch.tensor([16.0, 16.0, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(seen[1], torch.tensor([0.0, 0.0, 16.0, 16.0], dtype=torch.float64), rtol=0, atol=0)
    assert isinstance(layer.dispatcher, AllToAllDispatcher)  # unwrapped at the end
