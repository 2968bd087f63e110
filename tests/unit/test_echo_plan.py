"""ECHO planner: clone placement on hand-worked loads, and the per-source token split.

Legend: P EP ranks, e home experts per rank, S spare slots per rank; physical slot of expert g
at home is ``(g // e) * (e + S) + g % e``, spare slot j of rank p is ``p * (e + S) + e + j``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.metrics import max_over_mean
from lightning_moe.moe.dispatch.echo_plan import identity_plan, plan_clones


def test_two_hot_experts_on_one_rank_spread_to_the_three_idle_ranks() -> None:
    # P=4, e=2, S=1: experts 0 and 1 (both on rank 0) take all 2N = 200 slots; target 50 per rank.
    plan = plan_clones(torch.tensor([100, 100, 0, 0, 0, 0, 0, 0]), ep_size=4, spare_slots=1)
    # step 1: expert 0 (tie -> lower id) sends 50 to rank 1; step 2: expert 1 sends 50 to rank 2;
    # step 3: expert 0 (50 left, tie with expert 1) sends its last 50 to rank 3.
    assert plan.clone_expert_PS.tolist() == [[-1], [0], [1], [0]]
    assert plan.planned_rank_load(torch.tensor([100, 100, 0, 0, 0, 0, 0, 0])).tolist() == [50.0] * 4
    assert plan.replica_slot_EM[0].tolist() == [0, 5, 11]  # home, rank 1 spare, rank 3 spare
    assert plan.replica_cut_EM[0].tolist() == [0.0, 0.5, 1.0]
    assert plan.replica_slot_EM[1].tolist()[:2] == [1, 8] and plan.replica_cut_EM[1].tolist()[:2] == [0.5, 1.0]
    assert plan.num_clones == 3


def test_balanced_load_needs_no_clone() -> None:
    plan = plan_clones(torch.full((8,), 7), ep_size=4, spare_slots=2)
    assert plan.num_clones == 0
    assert plan.clone_expert_PS.tolist() == [[-1, -1]] * 4


def test_without_spare_slots_nothing_moves() -> None:
    load_E = torch.tensor([90, 10, 0, 0])
    plan = plan_clones(load_E, ep_size=2, spare_slots=0)
    assert plan.num_clones == 0
    assert plan.planned_rank_load(load_E).tolist() == [100.0, 0.0]


def test_tolerance_stops_early() -> None:
    load_E = torch.tensor([60, 40, 50, 50])  # ranks [100, 100]: already balanced
    assert plan_clones(load_E, ep_size=2, spare_slots=1).num_clones == 0
    load_E = torch.tensor([65, 45, 50, 40])  # ranks [110, 90], target 100
    assert plan_clones(load_E, ep_size=2, spare_slots=1, tolerance=0.2).num_clones == 0
    plan = plan_clones(load_E, ep_size=2, spare_slots=1)
    assert plan.planned_rank_load(load_E).tolist() == [100.0, 100.0]
    assert plan.clone_expert_PS.tolist() == [[-1], [0]]  # 10 tokens of expert 0 go to rank 1


@pytest.mark.parametrize("seed", range(4))
def test_random_skewed_loads_end_within_tolerance_with_enough_slots(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    load_E = (torch.rand(16, generator=g) ** 6 * 1000).round()
    plan = plan_clones(load_E, ep_size=4, spare_slots=4)
    before = max_over_mean(load_E.view(1, 4, 4).sum(-1)).item()
    after = max_over_mean(plan.planned_rank_load(load_E).view(1, 4)).item()
    assert after <= 1.0 + 1e-9 < before
    assert plan.planned_rank_load(load_E).sum().item() == pytest.approx(load_E.sum().item())


def test_one_expert_never_gets_two_replicas_on_one_rank() -> None:
    plan = plan_clones(torch.tensor([1000, 0, 0, 0]), ep_size=2, spare_slots=3)
    assert plan.clone_expert_PS.tolist() == [[-1, -1, -1], [0, -1, -1]]


def test_physical_ids_split_each_experts_slots_in_token_order() -> None:
    plan = plan_clones(torch.tensor([100, 100, 0, 0, 0, 0, 0, 0]), ep_size=4, spare_slots=1)
    # this source routes 4 slots to expert 0, 2 to expert 1, 1 to expert 6, one dropped slot
    ids_TK = torch.tensor([[0, 1], [0, 6], [1, 0], [0, -1]])
    # expert 0 cuts at floor([0, .5, 1] * 4) = [0, 2, 4]: slots 0,1 -> slot 5; 2,3 -> slot 11
    # expert 1 cuts at floor([.5, 1] * 2) = [1, 2]: first slot home (1), second -> slot 8
    assert plan.physical_ids(ids_TK).tolist() == [[5, 1], [5, 3 * 3 + 0], [8, 11], [11, -1]]


def test_identity_plan_maps_every_expert_home() -> None:
    plan = identity_plan(8, ep_size=4, spare_slots=2)
    ids_TK = torch.arange(8).view(4, 2)
    expected = [(g // 2) * 4 + g % 2 for g in range(8)]
    assert plan.physical_ids(ids_TK).reshape(-1).tolist() == expected
    assert [plan.home_slot(g) for g in range(8)] == expected
    assert plan.num_clones == 0


def test_expert_with_no_tokens_and_empty_input_are_handled() -> None:
    plan = plan_clones(torch.tensor([10, 0, 0, 0]), ep_size=2, spare_slots=1)
    assert plan.physical_ids(torch.empty(0, 2, dtype=torch.long)).shape == (0, 2)
    assert plan.physical_ids(torch.tensor([[1, 2]])).tolist() == [[1, 3]]  # unplanned experts stay home


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"load_E": torch.ones(6), "ep_size": 4, "spare_slots": 1}, "ep_size=4 must be >= 1 and divide num_experts=6"),
        ({"load_E": torch.ones(8), "ep_size": 4, "spare_slots": -1}, "spare_slots=-1 must be >= 0"),
        ({"load_E": torch.ones(8), "ep_size": 4, "spare_slots": 1, "tolerance": -0.1}, "tolerance=-0.1"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_clones(**kwargs)


def test_physical_ids_split_ignores_dropped_slots_ahead_of_an_experts_slots() -> None:
    plan = plan_clones(torch.tensor([100, 100, 0, 0, 0, 0, 0, 0]), ep_size=4, spare_slots=1)
    # The dropped slot (0, 0) comes first and must not count as one of expert 0's slots:
    # expert 0 has 4 slots, cuts floor([0, .5, 1] * 4) = [0, 2, 4]: slots 0,1 -> slot 5; 2,3 -> slot 11
    # expert 1 has 2 slots, cuts [1, 2]: first home (1), second -> slot 8; expert 6 stays home (9).
    ids_TK = torch.tensor([[-1, 0], [0, 1], [1, 0], [0, 6]])
    assert plan.physical_ids(ids_TK).tolist() == [[-1, 5], [5, 1], [8, 11], [11, 9]]
