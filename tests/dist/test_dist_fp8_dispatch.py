"""FP8 token dispatch on 4 gloo ranks: all-to-all, flex over alltoall_dedup and the DeepEP stand-in,
EP2, EP4 and ETP2 x EP2, against the local FP8 dispatch of one process; ETP under sequence
parallel; bytes on the wire.

One torchrun job runs every case (``worker_fp8_dispatch.py``); the worker compares outputs and the
gradients of x, the routing weights, w13 and w2 itself (fp32, 1e-6) and prints a line per case.
"""

from __future__ import annotations

import pytest

from _harness import run_torchrun

pytestmark = pytest.mark.dist

CASES = [
    "alltoall:1:2:1", "alltoall:1:4:1", "alltoall:2:2:2",
    "dedup:1:2:1", "dedup:1:4:1", "dedup:2:2:2",
    "deepep:1:4:1", "deepep:2:2:2",
]  # fmt: skip


@pytest.fixture(scope="module")
def job_output() -> str:
    parts = [*CASES, "sp:alltoall", "sp:dedup", "layer:alltoall", "layer:dedup", "bytes:alltoall", "bytes:dedup"]
    return run_torchrun("worker_fp8_dispatch.py", 4, parts, timeout=540)


@pytest.mark.parametrize("case", CASES)
def test_fp8_dispatch_equals_local_fp8_dispatch_with_empty_ranks_empty_experts_and_etp(job_output: str, case: str) -> None:
    kind, tp, ep, etp = case.split(":")
    assert f"OK {kind} tp={tp} ep={ep} etp={etp}" in job_output


@pytest.mark.parametrize("kind", ["alltoall", "dedup"])
def test_fp8_rows_are_gathered_over_etp_under_sequence_parallel(job_output: str, kind: str) -> None:
    """ETP ranks holding different tokens: FP8 rows all-gathered over ETP equal the same rounded tokens
    moved in the activation dtype (outputs and every gradient)."""
    assert f"OK {kind} sequence-parallel etp=2 ep=2" in job_output


@pytest.mark.parametrize("kind", ["alltoall", "dedup"])
def test_moe_layer_with_fp8_dispatch_equals_fp8_experts_quantizing_exchanged_rows(job_output: str, kind: str) -> None:
    """MoELayer over an EP4 dispatcher: Fp8Config(dispatch=True) makes the layer ask for FP8 rows and
    hand them to its experts; output and gradients equal dispatch=False."""
    assert f"OK {kind} layer" in job_output


@pytest.mark.parametrize("kind", ["alltoall", "dedup"])
def test_fp8_rows_move_about_half_the_bytes_of_bf16_rows_in_one_exchange(job_output: str, kind: str) -> None:
    line = next(x for x in job_output.splitlines() if x.startswith(f"BYTES {kind} "))
    ratios = [float(part.split("(")[1].rstrip(")")) for part in line.split() if part.startswith("(")]
    assert len(ratios) == 2 and all(0.5 < r <= 0.516 for r in ratios), line
