"""Context parallelism on 4 gloo ranks equals one process.

``worker_context.py`` checks, on CP=2 (two groups at once) and CP=4: the attention output and the
q/k/v gradients of every rank's shard against the whole-sequence attention, with and without
document ids (positions global or restarting per document), with grouped kv heads and an empty
batch; the whole MoETransformer forward and backward at CP=2; the bytes kept for backward per rank
at CP=4 against one rank; and decreasing document ids refused on every rank of the group (no hang).
"""

from __future__ import annotations

import pytest
from _harness import run_torchrun

pytestmark = pytest.mark.dist

CHECKS = ("attention cp=2", "attention cp=4", "model cp=2", "memory cp=4", "bad documents cp=2")


def test_context_parallel_matches_one_process_on_two_and_four_ranks() -> None:
    out = run_torchrun("worker_context.py", 4, [], timeout=400)
    missing = [name for name in CHECKS if f"OK {name}\n" not in out]
    assert not missing, f"checks {missing} did not finish:\n{out[-4000:]}"
    assert "ALL OK" in out, out[-4000:]
