"""``CommTurns``: two sides of an overlapped pipeline action take turns at their all-to-alls; and
the pieces that put them into a pipeline (``parallel/pipeline_overlap.py``).

The multi-rank order (the expert all-to-all of one micro-batch in flight while another computes,
the numbers unchanged) is ``tests/dist/test_dist_pipeline_overlap.py``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import AllToAllDispatcher
from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.pipeline_overlap import attach_comm_turns, check_overlap_schedule


def _side(log: list[str], label: str, turns: CommTurns, exchanges: int) -> None:
    """Compute, then for each exchange: start it, hand over, wait, compute."""
    log.append(f"{label} compute")
    for n in range(exchanges):
        log.append(f"{label} starts {n}")
        turns.hand_over()
        log.append(f"{label} wait {n}")
        log.append(f"{label} compute")


def test_each_side_computes_while_the_other_ones_exchange_is_in_flight() -> None:
    turns, log = CommTurns(), []
    turns.run_pair(lambda: _side(log, "F", turns, 2), lambda: _side(log, "B", turns, 3))
    assert log == [
        "F compute", "F starts 0",
        "B compute", "B starts 0",
        "F wait 0", "F compute", "F starts 1",
        "B wait 0", "B compute", "B starts 1",
        "F wait 1", "F compute",  # the forward ends: the backward goes on alone
        "B wait 1", "B compute", "B starts 2", "B wait 2", "B compute",
    ]  # fmt: skip


def test_the_backward_runs_on_a_named_helper_thread_and_the_forward_here() -> None:
    turns, seen = CommTurns(), {}
    turns.run_pair(
        lambda: seen.update(first=threading.current_thread().name),
        lambda: seen.update(second=threading.current_thread().name),
        name="pipeline-backward-stage3-mb1",
    )
    assert seen == {"first": threading.current_thread().name, "second": "pipeline-backward-stage3-mb1"}


def test_hand_over_outside_a_pair_returns_at_once() -> None:
    CommTurns().hand_over()


def test_an_error_of_one_side_is_raised_after_the_other_side_ran_to_its_end() -> None:
    turns, log = CommTurns(), []

    def failing() -> None:
        turns.hand_over()
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        turns.run_pair(lambda: _side(log, "F", turns, 3), failing)
    assert log[-1] == "F compute" and log.count("F wait 2") == 1


def test_pairs_do_not_nest() -> None:
    turns = CommTurns()
    with pytest.raises(RuntimeError, match="pairs do not nest"):
        turns.run_pair(lambda: turns.run_pair(lambda: None, lambda: None), lambda: None)


def _layer() -> MoELayer:
    return MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2), layer_name="layers.1.mlp")


def test_attach_gives_the_turns_to_all_to_all_dispatchers_and_refuses_others() -> None:
    layer, turns = _layer(), CommTurns()
    with pytest.raises(ValueError, match="'layers.1.mlp' dispatches with LocalDispatcher"):
        attach_comm_turns(layer, turns)
    fake_group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    layer.dispatcher = AllToAllDispatcher(4, ep_group=fake_group)  # type: ignore[arg-type]
    assert attach_comm_turns(layer, turns) == 1 and layer.dispatcher.comm_turns is turns


def test_a_torch_without_custom_overlap_actions_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining import schedules

    check_overlap_schedule("S", "dualpipev")
    monkeypatch.delattr(schedules._PipelineScheduleRuntime, "register_custom_function")
    with pytest.raises(ValueError, match="needs register_custom_function on its runtime schedules, which torch"):
        check_overlap_schedule("S", "dualpipev")
