"""FP8 dense layers under tensor parallelism (2 gloo ranks) equal one process (``worker_fp8_tp.py``)."""

from __future__ import annotations

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist


def test_fp8_dense_layers_under_tp2_equal_one_process() -> None:
    out = run_torchrun("worker_fp8_tp.py", 2, [], timeout=300)
    assert "OK fp8 dense tp=2" in out, out[-4000:]
