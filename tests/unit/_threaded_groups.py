"""Ranks as threads of one process: each thread gets its own gloo ``ProcessGroup`` over one
in-memory store, so collective code runs at TP 2 or 4 without starting processes."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _group(store: Any, rank: int, size: int) -> dist.ProcessGroup:
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def run_ranks(size: int, body: Callable[[dist.ProcessGroup, int], None], timeout_s: float = 120.0) -> None:
    """``body(group, rank)`` on ``size`` threads; the first exception of any rank is raised here."""
    store = dist.PrefixStore(f"ranks{size}", dist.HashStore())
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            body(_group(store, rank, size), rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    if any(t.is_alive() for t in threads):
        pytest.fail(f"{size} ranks: one did not finish within {timeout_s} s (a collective without its peers)")
    if errors:
        raise errors[0]
