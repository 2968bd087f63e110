"""Unit tests run in one process: a process group one test module leaves open (Lightning's
strategies make one and keep it) is destroyed after that module, so the fake-world tests of a
later module start from none instead of skipping. Lightning's seed variables (``PL_GLOBAL_SEED``,
``PL_SEED_WORKERS``: ``seed_everything`` and the CLI's ``seed_everything`` key set them, every
strategy reseeds from them when it sets up its environment) are put back after each test.
``tok_dir`` is the tiny BPE tokenizer the data tests load (one per module)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_lightning_seed_outlives_its_test() -> Iterator[None]:
    """A test that runs the CLI in this process (or calls ``seed_everything``) leaves the seed in
    ``os.environ``; a later test's Trainer or Fabric would reseed from it when its strategy sets up."""
    saved = {name: os.environ.get(name) for name in _SEED_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
