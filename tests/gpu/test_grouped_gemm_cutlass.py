"""The CUTLASS grouped expert GEMM (csrc/cutlass/grouped_gemm*) against fp32 torch and F.grouped_mm.

Legend: R rows grouped by expert, K the rows' width, N the output width, E experts.

Every tiling, with w read N-major (the forward) and K-major (the data gradient), on ragged row
counts with empty experts. Tolerance: bf16 output, relative Frobenius error per expert <= 1e-2
against a per-expert fp32 product. The op allocates its output; each call runs right after a block
of the same size was filled with NaN and freed, so the caching allocator hands that block back
(checked by pointer) and an element the kernel never wrote stays NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.ops import build_cutlass, grouped_gemm_cutlass

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("needs_cutlass")]  # tests/gpu/conftest.py

TOL = 1e-2
LAYOUTS = ("n-major", "k-major")


def _counts(num_experts: int, rows: int, gen: torch.Generator, empty: tuple[int, ...]) -> list[int]:
    """Random row counts summing to ``rows``, zero for the experts in ``empty``."""
    weights = torch.rand(num_experts, generator=gen) + 0.05
    weights[list(empty)] = 0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[int(weights.argmax())] += rows - int(counts.sum())
    return counts.tolist()


def _weights(num_experts: int, k: int, n: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """w_EKN in the layout asked for: K-major is the transpose of a contiguous [E, N, K]."""
    if layout == "n-major":
        return (torch.randn(num_experts, k, n, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    return (torch.randn(num_experts, n, k, generator=gen) * 0.05).to("cuda", torch.bfloat16).transpose(1, 2)


def _reference(a_RK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows [0, sum(counts)) of the product, per expert in fp32."""
    out = torch.zeros(sum(counts), w_EKN.shape[2], device=a_RK.device)
    lo = 0
    for e, count in enumerate(counts):
        out[lo : lo + count] = a_RK[lo : lo + count].float() @ w_EKN[e].float()
        lo += count
    return out


def _call_poisoned(fn: Callable[[], torch.Tensor], rows: int, n: int) -> torch.Tensor:
    """Run ``fn`` so that its [rows, n] bf16 output lands on memory just filled with NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poison = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptr = poison.data_ptr()
    del poison
    out = fn()
    assert out.data_ptr() == ptr, "the caching allocator did not return the poisoned block; unwritten rows would pass"
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _assert_matches(out_RN: torch.Tensor, expected: torch.Tensor, counts: list[int], what: str) -> None:
    rows = sum(counts)
    assert out_RN.shape[0] >= rows
    written = out_RN[:rows]
    bad = ~torch.isfinite(written)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements not written, first at {bad.nonzero()[0].tolist()}"
    lo = 0
    for e, count in enumerate(counts):
        if count:
            err = _rel(written[lo : lo + count], expected[lo : lo + count])
            assert err <= TOL, f"{what}: expert {e} ({count} rows) rel err {err:.2e}"
        lo += count


CASES = {
    # name: (E, rows routed, spare rows past the last expert, K, N, experts without rows)
    "ragged, empty first/middle/last": (8, 1000, 24, 128, 256, (0, 3, 7)),
    "all rows in one expert": (4, 300, 0, 64, 64, (0, 1, 3)),
    "odd multiples of 8": (6, 517, 5, 40, 24, (2,)),
    "wide": (8, 2000, 0, 2048, 1536, (4,)),
    "one expert": (1, 333, 3, 256, 128, ()),
    "fewer rows than experts": (16, 5, 0, 16, 8, ()),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiling", sorted(grouped_gemm_cutlass.TILES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_multiplies_like_the_fp32_reference_and_grouped_mm(case: str, tiling: str, layout: str) -> None:
    num_experts, routed, spare, k, n, empty = CASES[case]
    gen = torch.Generator().manual_seed(num_experts * 1000 + routed + k)
    if case == "fewer rows than experts":  # most experts empty, at random places
        counts = [0] * num_experts
        for e in torch.randperm(num_experts, generator=gen)[:routed].tolist():
            counts[e] = 1
    else:
        counts = _counts(num_experts, routed, gen, empty)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(routed + spare, k, generator=gen).to("cuda", torch.bfloat16)
    w = _weights(num_experts, k, n, layout, gen)
    assert grouped_gemm_cutlass.supported(a, w)
    out = _call_poisoned(lambda: grouped_gemm_cutlass.grouped_mm(a, w, offs, tiling=tiling), routed + spare, n)
    torch.cuda.synchronize()
    assert out.shape == (routed + spare, n) and out.dtype == torch.bfloat16
    _assert_matches(out, _reference(a, w, counts), counts, f"{tiling} {layout}")
    theirs = F.grouped_mm(a, w, offs=offs)
    _assert_matches(out, theirs.float(), counts, f"{tiling} {layout} vs F.grouped_mm")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_rows_routed_writes_nothing_and_no_rows_returns_empty(layout: str) -> None:
    gen = torch.Generator().manual_seed(5)
    w = _weights(4, 32, 16, layout, gen)
    offs = torch.zeros(4, dtype=torch.int32, device="cuda")
    a = torch.randn(7, 32, generator=gen).to("cuda", torch.bfloat16)
    out = grouped_gemm_cutlass.grouped_mm(a, w, offs)  # every expert M = 0: no tiles
    torch.cuda.synchronize()
    assert out.shape == (7, 16)
    empty = grouped_gemm_cutlass.grouped_mm(a[:0], w, offs)
    assert empty.shape == (0, 16)


def test_follows_the_current_stream() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = [40, 0, 81, 7]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(sum(counts), 64, generator=gen).to("cuda", torch.bfloat16)
    w = _weights(4, 64, 32, "k-major", gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = grouped_gemm_cutlass.grouped_mm(a, w, offs)
    torch.cuda.current_stream().wait_stream(side)
    _assert_matches(out, _reference(a, w, counts), counts, "side stream")


def _inputs(k: int = 16, n: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, k, n, device="cuda", dtype=torch.bfloat16)
    return a, w, torch.tensor([4, 8], dtype=torch.int32, device="cuda")


def test_a_wrong_dtype_is_refused_naming_it() -> None:
    a, w, offs = _inputs()
    with pytest.raises(RuntimeError, match=r"a\.dtype=Float must be BFloat16"):
        grouped_gemm_cutlass.grouped_mm(a.float(), w, offs)
    assert not grouped_gemm_cutlass.supported(a.float(), w)


def test_a_non_contiguous_a_is_refused_with_the_fix() -> None:
    _, w, offs = _inputs()
    a = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16).t()
    with pytest.raises(RuntimeError, match=r"a is not contiguous; pass a.contiguous\(\)"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs)


def test_w_in_neither_layout_is_refused_with_both_fixes() -> None:
    a, _, offs = _inputs()
    w = torch.randn(2, 16, 32, device="cuda", dtype=torch.bfloat16)[:, :, ::2]  # strides (512, 32, 2)
    with pytest.raises(RuntimeError, match=r"w has strides \(512, 32, 2\) for shape \[2, 16, 16\]; it must be N-major"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs)
    fix = r"pass w.contiguous\(\) or w.transpose\(1, 2\).contiguous\(\).transpose\(1, 2\)"
    with pytest.raises(RuntimeError, match=fix):
        grouped_gemm_cutlass.grouped_mm(a, w, offs)
    assert not grouped_gemm_cutlass.supported(a, w)


def test_a_misaligned_view_is_refused() -> None:
    _, w, offs = _inputs()
    a = torch.randn(8 * 16 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(8, 16)  # 2 bytes past 16-byte alignment
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs)


def test_k_not_a_multiple_of_8_is_refused_naming_it() -> None:
    a, w, offs = _inputs(k=12)
    with pytest.raises(RuntimeError, match="K=12 and N=16 must be positive multiples of 8"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs)
    assert not grouped_gemm_cutlass.supported(a, w)


def test_int64_offsets_are_refused_naming_the_dtype() -> None:
    a, w, offs = _inputs()
    with pytest.raises(RuntimeError, match=r"offsets\.dtype=Long must be Int"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs.long())


def test_shapes_that_disagree_are_refused() -> None:
    a, w, _ = _inputs()
    with pytest.raises(RuntimeError, match=r"shapes disagree: a \[8, 16\], w \[2, 16, 16\], offsets \[3\]"):
        grouped_gemm_cutlass.grouped_mm(a, w, torch.tensor([1, 2, 8], dtype=torch.int32, device="cuda"))


def test_an_unknown_tiling_is_refused_naming_it() -> None:
    a, w, offs = _inputs()
    with pytest.raises(RuntimeError, match="tiling='nope' is unknown"):
        grouped_gemm_cutlass.grouped_mm(a, w, offs, tiling="nope")
    ops = build_cutlass.load_cutlass_extension()
    tiles = len(grouped_gemm_cutlass.TILES)
    with pytest.raises(RuntimeError, match=f"tile={tiles} is not a tiling \\(0 to {tiles - 1}"):
        ops.grouped_mm(a, w, offs, tiles)


@pytest.mark.parametrize("lean", [False, True])
def test_the_layer_through_cutlass_matches_it_through_grouped_mm(lean, monkeypatch) -> None:  # noqa: ANN001
    """KernelConfig(gemm="cutlass") sends every forward and data-gradient GEMM of the layer
    through the CUTLASS kernel (counted); output and every gradient match F.grouped_mm's."""
    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.config import KernelConfig

    layers = {}
    for kernel in ("cutlass", "torch"):
        torch.manual_seed(0)
        cfg = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, kernels=KernelConfig(gemm=kernel))
        layers[kernel] = MoELayer(cfg).cuda().to(torch.bfloat16)
        layers[kernel].experts.lean_backward = lean
    x = torch.randn(333, 256, device="cuda", dtype=torch.bfloat16)
    go = torch.randn(333, 256, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = grouped_gemm_cutlass.grouped_mm
    monkeypatch.setattr(grouped_gemm_cutlass, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    def step(kernel: str):  # noqa: ANN202
        layer = layers[kernel]
        layer.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        y.backward(go)
        return [y, xr.grad] + [p.grad for p in layer.parameters()]

    through_cutlass = step("cutlass")
    assert len(calls) == 4, calls  # up and down forward, both data gradients
    through_torch = step("torch")
    assert len(calls) == 4
    for got, want in zip(through_cutlass, through_torch):
        assert _rel(got, want) <= 1e-2
