"""Unit tests run in one process: a process group one test module leaves open (Lightning's
strategies make one and keep it) is destroyed after that module, so the fake-world tests of a
later module start from none instead of skipping."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
