"""Unit tests run in one process: a process group one test module leaves open (Lightning's
strategies make one and keep it) is destroyed after that module, so the fake-world tests of a
later module start from none instead of skipping. ``tok_dir`` is the tiny BPE tokenizer the data
tests load (one per module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fake_world() -> Iterator[Callable[[int, int], None]]:
    """``fake_world(rank, world)``: make this process ``rank`` of a fake world (``fake`` backend:
    collectives move no data; a second call replaces the first), torn down after the test."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (an earlier test in this module left it)")

    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny BPE tokenizer of ``_tiny_tokenizer.py`` (chat template without generation marks)."""
    from _tiny_tokenizer import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
