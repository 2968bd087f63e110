"""The collectives along one dimension equal their plain-tensor definitions on 2 and 4 ranks
(ranks as threads of this process), along the first, a middle and the last dimension."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _threaded_groups import run_ranks

from lightning_moe.parallel.collectives import all_gather_cat, group_size, reduce_scatter_cat


def _per_rank(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(world)
    return torch.randn(world, 2 * world, 3 * world, world, generator=g, dtype=torch.float64)  # one [2w, 3w, w] per rank


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_cat_and_reduce_scatter_cat_equal_cat_and_a_chunk_of_the_sum(world: int, dim: int) -> None:
    x_w = _per_rank(world)

    def body(group: Any, r: int) -> None:
        assert group_size(group) == world
        torch.testing.assert_close(all_gather_cat(x_w[r], group, dim), torch.cat(list(x_w), dim=dim))
        expected = x_w.sum(0).chunk(world, dim=dim)[r]
        torch.testing.assert_close(reduce_scatter_cat(x_w[r], group, dim), expected)

    run_ranks(world, body)


def test_a_group_of_none_needs_no_collective_and_an_uneven_length_is_refused() -> None:
    x = torch.randn(2, 5)
    assert group_size(None) == 1
    assert all_gather_cat(x, None, 1) is x and reduce_scatter_cat(x, None, 1) is x

    def body(group: Any, r: int) -> None:
        with pytest.raises(ValueError, match="dim 1 has length 5, not a multiple of the group size 2"):
            reduce_scatter_cat(x, group, 1)

    run_ranks(2, body)
