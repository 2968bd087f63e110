"""The CUTLASS grouped weight-gradient GEMM (csrc/cutlass) against a plain-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("needs_cutlass")]  # tests/gpu/conftest.py


def _counts(num_experts: int, rows: int, gen: torch.Generator, empty: int) -> list[int]:
    """Random row counts summing to ``rows`` with ``empty`` experts given none."""
    weights = torch.rand(num_experts, generator=gen)
    weights[torch.randperm(num_experts, generator=gen)[:empty]] = 0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[int(weights.argmax())] += rows - int(counts.sum())
    return counts.tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("tiling", sorted(wgrad_cutlass.TILES))
@pytest.mark.parametrize(
    "num_experts,rows,m,n,empty",
    [
        (8, 1000, 64, 96, 0),  # odd row counts, tiles partly outside M and N
        (16, 777, 136, 264, 5),  # empty experts: their gradient must stay as it was
        (4, 3, 8, 8, 2),  # fewer rows than experts, one 8 x 8 weight
        (32, 4096, 256, 512, 1),
        (3, 5000, 128, 128, 0),  # a long K per expert
    ],
)
def test_accumulates_like_the_reference(num_experts, rows, m, n, empty, tiling) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(num_experts * 1000 + rows)
    counts = _counts(num_experts, rows, gen, empty)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    spare = 5  # rows past the last expert's end: must be ignored
    x = torch.randn(rows + spare, m, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(rows + spare, n, generator=gen).to("cuda", torch.bfloat16)
    grad = torch.randn(num_experts, m, n, generator=gen).to("cuda", torch.bfloat16)
    expected = grad.clone()
    wgrad_cutlass.reference_accumulate_(expected, x, dy, offs)
    wgrad_cutlass.grouped_wgrad_accumulate_(grad, x, dy, offs, tiling=tiling)
    torch.cuda.synchronize()
    for e, count in enumerate(counts):
        if count == 0:  # untouched: bitwise
            assert torch.equal(grad[e], expected[e]), f"expert {e} has no rows but its gradient changed"
        else:
            assert _rel(grad[e], expected[e]) <= 1e-2, f"expert {e} ({count} rows)"


def test_accumulates_twice_and_follows_the_current_stream() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = [40, 0, 81, 7]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(sum(counts), 64, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(sum(counts), 32, generator=gen).to("cuda", torch.bfloat16)
    grad = torch.zeros(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    expected = grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            wgrad_cutlass.grouped_wgrad_accumulate_(grad, x, dy, offs)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        wgrad_cutlass.reference_accumulate_(expected, x, dy, offs)
    assert _rel(grad, expected) <= 1e-2


def test_bad_input_is_refused_naming_it() -> None:
    offs = torch.tensor([4, 8], dtype=torch.int32, device="cuda")
    x = torch.randn(8, 12, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="M=12 and N=16 must be multiples of 8"):
        wgrad_cutlass.grouped_wgrad_accumulate_(torch.zeros(2, 12, 16, device="cuda", dtype=torch.bfloat16), x, dy, offs)
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="grad.dtype=Float must be BFloat16"):
        wgrad_cutlass.grouped_wgrad_accumulate_(torch.zeros(2, 16, 16, device="cuda"), x, dy, offs)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        wgrad_cutlass.grouped_wgrad_accumulate_(torch.zeros(3, 16, 16, device="cuda", dtype=torch.bfloat16), x, dy, offs)
    assert not wgrad_cutlass.supported(x.float(), torch.zeros(2, 16, 16, device="cuda"))
    assert not wgrad_cutlass.supported(x, torch.zeros(2, 12, 16, device="cuda", dtype=torch.bfloat16))
