"""MoE load metrics: hand-worked values, accumulation, reset, and shape errors (one process)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.metrics import (
    ExpertLoad,
    LayerMean,
    RankLoad,
    max_over_mean,
    rank_load_from_experts,
)


def test_max_over_mean_is_one_when_balanced_and_e_when_one_expert_takes_all() -> None:
    load_LE = torch.tensor([[4, 4, 4, 4], [16, 0, 0, 0], [6, 2, 0, 0], [0, 0, 0, 0]])
    assert max_over_mean(load_LE).tolist() == [1.0, 4.0, 3.0, 1.0]


def test_rank_load_sums_each_ranks_contiguous_experts() -> None:
    tokens_LE = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert rank_load_from_experts(tokens_LE, 2).tolist() == [[10, 26]]
    assert rank_load_from_experts(tokens_LE, 4).tolist() == [[3, 7, 11, 15]]
    with pytest.raises(ValueError, match="ep_size=3 must divide num_experts=8"):
        rank_load_from_experts(tokens_LE, 3)


def test_expert_load_accumulates_updates_until_reset() -> None:
    metric = ExpertLoad(num_layers=2, num_experts=3)
    metric.update(torch.tensor([[1, 0, 2], [0, 0, 3]]))
    metric.update(torch.tensor([[1, 1, 0], [3, 0, 0]]))
    assert metric.compute().tolist() == [[2, 1, 2], [3, 0, 3]]
    metric.reset()
    assert metric.tokens_LE.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_rank_load_accumulates_rows_sent_to_each_rank() -> None:
    metric = RankLoad(num_layers=1, ep_size=4)
    metric.update(torch.tensor([[5, 0, 1, 2]]))
    metric.update(torch.tensor([[3, 0, 1, 2]]))
    rows_LP = metric.compute()
    assert rows_LP.tolist() == [[8, 0, 2, 4]]
    assert max_over_mean(rows_LP).item() == pytest.approx(8 / 3.5)


def test_layer_mean_skips_layers_without_a_value() -> None:
    metric = LayerMean(num_layers=3)
    metric.update(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([True, True, False]))
    metric.update(torch.tensor([3.0, 0.0, 0.0]), torch.tensor([True, False, False]))
    assert metric.compute().tolist() == [2.0, 2.0, 0.0]


@pytest.mark.parametrize(
    ("make", "bad", "match"),
    [
        (lambda: ExpertLoad(2, 4), torch.zeros(2, 3), r"shape \(2, 3\), expected \(2, 4\)"),
        (lambda: RankLoad(2, 4), torch.zeros(4), r"shape \(4,\), expected \(2, 4\)"),
        (lambda: LayerMean(2), torch.zeros(3), r"shape \(3,\), expected \(2,\)"),
    ],
)
def test_update_with_wrong_shape_names_both_shapes(make, bad: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make().update(bad)


def test_non_positive_sizes_are_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="ExpertLoad: num_experts=0 must be a positive int"):
        ExpertLoad(2, 0)
    with pytest.raises(ValueError, match="RankLoad: ep_size=0"):
        RankLoad(2, 0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ExpertLoad(2, 2.5), "ExpertLoad: num_experts=2.5 must be a positive int"),
        (lambda: RankLoad(2.0, 4), "RankLoad: num_layers=2.0 must be a positive int"),
        (lambda: LayerMean(1.5), "LayerMean: num_layers=1.5 must be a positive int"),
        (lambda: LayerMean(True), "LayerMean: num_layers=True must be a positive int"),
    ],
)
def test_non_int_sizes_are_rejected_at_construction_naming_the_value(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()
