"""``mean_over_ranks`` without a process group and on a one-rank group (several ranks: tests/dist/test_dist_fit.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_moe.parallel.rank_mean import mean_over_ranks


def test_without_a_process_group_the_value_is_returned() -> None:
    v = torch.tensor(3.0)
    assert mean_over_ranks(v) is v


def test_one_rank_returns_the_value_and_issues_no_barrier(tmp_path, monkeypatch) -> None:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: (_ for _ in ()).throw(AssertionError("barrier")))
        v = torch.tensor(2.5)
        assert mean_over_ranks(v) is v
    finally:
        if created:
            dist.destroy_process_group()
