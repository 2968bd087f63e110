"""FP8 experts on CUDA: the torch and cutlass FP8 backends equal the emulate backend (the same FP8
operands, dequantized and multiplied in fp32) in the output and every gradient, on the grouped rows
path and the fused local path, with degenerate routings; both sides run the same weight-gradient
precision (``Fp8Config.wgrad``). The fast path (``backend="auto"``, blockwise) runs the csrc
quantization kernels and the CUTLASS FP8 GEMM and adds no host synchronisation over bf16."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.config import Fp8Config
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.fp8.quantize import quantize
from lightning_moe.ops.permute import build_permutation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)",
    ),
]

H, F, E = 512, 384, 8
CASES = [("torch", "tensorwise"), ("torch", "rowwise"), ("torch", "blockwise"), ("cutlass", "blockwise")]


def _experts(backend: str, recipe: str, h: int = H, f: int = F, **kw) -> GroupedExperts:
    torch.manual_seed(0)
    kw.setdefault("wgrad", "activation")  # the GPU backends' default; emulate is asked for the same
    ex = GroupedExperts(E, h, f, init_std=0.05, fp8=Fp8Config(recipe=recipe, backend=backend, **kw)).cuda()
    with torch.no_grad():
        ex.w13[2].mul_(8.0)
    return ex


def _available(backend: str, recipe: str, dtype: torch.dtype = torch.bfloat16) -> None:
    if backend == "cutlass":
        from lightning_moe.ops import build_cutlass

        reason = build_cutlass.cutlass_unavailable_reason()
        if reason is not None:
            pytest.skip(f"the CUTLASS FP8 kernel is unavailable here: {reason}")
        # fp32 activations: the GEMMs the kernel cannot write (bf16 only) run on the torch backend
    _experts(backend, recipe).fp8_options(torch.device("cuda"))


def _ids(kind: str, T: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    if kind == "empty_experts":
        return torch.stack([torch.tensor([1, 5])[torch.randperm(2, generator=g)] for _ in range(T)])
    if kind == "one_expert":
        return torch.full((T, 1), 3)
    return torch.zeros(0, 2, dtype=torch.long)


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        assert a is None and b is None
        return 0.0
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _grouped(ex: GroupedExperts, kind: str, dtype: torch.dtype, x_fp8: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    T = 0 if kind == "zero_tokens" else 300  # rows per expert not multiples of 16
    ids = _ids(kind, T, g)
    counts = torch.bincount(ids.reshape(-1), minlength=E).cuda()
    R = ids.numel()
    h = ex.hidden_size
    x = torch.randn(R, h, generator=g).cuda().to(dtype)
    w = (torch.rand(R, generator=g) + 0.1).cuda().requires_grad_(True)
    dy = torch.randn(R, h, generator=g).cuda().to(dtype)
    ex.zero_grad(set_to_none=True)
    if x_fp8:
        rows = quantize(x, ex.fp8.recipe, "e4m3")
        xr = torch.zeros((), device="cuda", dtype=dtype, requires_grad=True).expand(R, h)
    else:
        rows, xr = None, x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype == torch.bfloat16):
        y = ex(xr, counts, w, x_fp8=rows)
    (gx,) = torch.autograd.grad(y, xr, dy, retain_graph=True) if R else (None,)
    y.backward(dy)
    return dict(y=y.detach(), x=gx, w13=ex.w13.grad, w2=ex.w2.grad, w=w.grad)


def _local(ex: GroupedExperts, kind: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(2)
    T = 0 if kind == "zero_tokens" else 300
    ids = _ids(kind, T, g).cuda()
    perm = build_permutation(ids, E, None, True)
    x = torch.randn(T, H, generator=g).cuda().requires_grad_(True)
    w_TK = (torch.rand(ids.shape, generator=g) + 0.1).cuda().requires_grad_(True)
    dy = torch.randn(T, H, generator=g).cuda()
    ex.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype == torch.bfloat16):
        y = ex.forward_local(x, perm, lambda: w_TK.reshape(-1)[perm.slot_of_row_R])
    y.float().backward(dy)
    return dict(y=y.detach(), x=x.grad, w13=ex.w13.grad, w2=ex.w2.grad, w=w_TK.grad)


# The FP8 tensor-core GEMMs accumulate with less precision than fp32 (H200, torch backend,
# tensorwise, fp32 output: 0.45 % from emulation); bf16 outputs are rounded on top of that.
TOL = {torch.float32: 1e-2, torch.bfloat16: 2e-2}


def _compare(got: dict, want: dict, dtype: torch.dtype) -> None:
    for name in want:
        if want[name] is not None and want[name].numel() and want[name].abs().sum() == 0:
            assert got[name] is None or got[name].abs().sum() == 0, name
            continue
        assert _rel(got[name], want[name]) < TOL[dtype], (name, _rel(got[name], want[name]))


@pytest.mark.parametrize("kind", ["random", "empty_experts", "one_expert", "zero_tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("backend", "recipe"), CASES, ids=[f"{b}-{r}" for b, r in CASES])
def test_grouped_rows_equal_emulation(backend: str, recipe: str, dtype: torch.dtype, kind: str) -> None:
    _available(backend, recipe, dtype)
    _compare(_grouped(_experts(backend, recipe), kind, dtype), _grouped(_experts("emulate", recipe), kind, dtype), dtype)


@pytest.mark.parametrize("kind", ["random", "empty_experts", "one_expert", "zero_tokens"])
@pytest.mark.parametrize(("backend", "recipe"), CASES, ids=[f"{b}-{r}" for b, r in CASES])
def test_local_path_equals_emulation(backend: str, recipe: str, kind: str) -> None:
    _available(backend, recipe)
    dtype = torch.bfloat16
    _compare(_local(_experts(backend, recipe), kind, dtype), _local(_experts("emulate", recipe), kind, dtype), dtype)


@pytest.mark.parametrize(("backend", "recipe"), CASES[1:], ids=[f"{b}-{r}" for b, r in CASES[1:]])
def test_fp8_rows_from_the_exchange_equal_emulation(backend: str, recipe: str) -> None:
    _available(backend, recipe)
    dtype = torch.bfloat16
    got = _grouped(_experts(backend, recipe), "random", dtype, x_fp8=True)
    _compare(got, _grouped(_experts("emulate", recipe), "random", dtype, x_fp8=True), dtype)
    plain = _grouped(_experts(backend, recipe), "random", dtype)
    assert _rel(got["y"], plain["y"]) < TOL[dtype]  # the same rows, quantized by the caller


@pytest.mark.parametrize(("backend", "recipe"), CASES, ids=[f"{b}-{r}" for b, r in CASES])
def test_fp8_weight_gradients_equal_emulation(backend: str, recipe: str) -> None:
    """``wgrad="fp8"`` (quantized weight-gradient operands) on the GPU backends against emulate."""
    _available(backend, recipe)
    dtype = torch.bfloat16
    got = _grouped(_experts(backend, recipe, wgrad="fp8"), "empty_experts", dtype)
    _compare(got, _grouped(_experts("emulate", recipe, wgrad="fp8"), "empty_experts", dtype), dtype)


def _cutlass_or_skip() -> None:
    from lightning_moe.ops import build_cutlass
    from lightning_moe.ops.fp8 import kernels

    reason = build_cutlass.cutlass_unavailable_reason()
    if reason is not None or not kernels.cutlass_blockwise_available():
        pytest.skip(f"the CUTLASS FP8 kernel is unavailable here: {reason}")


@pytest.mark.parametrize("kind", ["random", "empty_experts", "one_expert"])
@pytest.mark.parametrize(("h", "f"), [(512, 384), (400, 200), (256, 136)], ids=["exact", "h400-f200", "h256-f136"])
def test_auto_fast_path_equals_emulation(h: int, f: int, kind: str) -> None:
    """The default blockwise config (``backend="auto"``): on sm_90 the CUTLASS GEMM, csrc quantization,
    cached weights; widths on and off the 128 grid (CUTLASS pads K and N to 16)."""
    _cutlass_or_skip()
    ex = _experts("auto", "blockwise", h, f)
    assert ex.fp8_options(torch.device("cuda")).backend == "cutlass"
    dtype = torch.bfloat16
    _compare(_grouped(ex, kind, dtype), _grouped(_experts("emulate", "blockwise", h, f), kind, dtype), dtype)


def _profiled_step(ex: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    ex(x.requires_grad_(True), counts, w).backward(torch.ones_like(x))  # warm-up: builds, weight copies
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ex(x, counts, w).backward(torch.ones_like(x))
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0 for _ in range(e.count)]


def _even_rows(R: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 rows, as many per expert, and their routing weights."""
    x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    return x, torch.tensor([R // E] * E, device="cuda"), torch.rand(R, device="cuda")


def test_fast_path_runs_the_fused_kernels_and_the_cutlass_gemm() -> None:
    _cutlass_or_skip()
    ex = _experts("auto", "blockwise").to(torch.bfloat16)
    names = _profiled_step(ex, *_even_rows())
    fp8_gemms = [n for n in names if "cutlass" in n and "device_kernel" in n and "e4m3" in n]
    assert len(fp8_gemms) == 4, names  # forward and data gradient of both projections, one launch each
    assert any("quantize_rows_kernel" in n for n in names), names  # csrc row / SwiGLU quantization
    assert not any("scaled_mm" in n.lower() or "scatter_reduce" in n.lower() for n in names), names
    # weights are cached: nothing reads the [E, H, 2F] master weight in a reduction after the warm-up
    assert not any("reduce_kernel" in n and "Max" in n for n in names), names


def _sync_warnings(ex: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> int:
    import warnings

    ex(x.requires_grad_(True), counts, w).backward(torch.ones_like(x))  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ex(x, counts, w).backward(torch.ones_like(x))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice that the debug mode is a prototype also says "Synchronization": count only
    # the warnings it raises for a synchronizing operation
    return sum("called a synchronizing CUDA operation" in str(c.message) for c in caught)


def test_fast_path_adds_no_host_sync_over_bf16() -> None:
    _cutlass_or_skip()
    x, counts, w = _even_rows()
    torch.manual_seed(0)
    bf16 = GroupedExperts(E, H, F, init_std=0.05).cuda().to(torch.bfloat16)
    fp8 = _experts("auto", "blockwise").to(torch.bfloat16)
    assert _sync_warnings(fp8, x, counts, w) <= _sync_warnings(bf16, x, counts, w)


def test_fp8_layer_trains_on_the_gpu() -> None:
    """A bf16-autocast FP8 layer with fp32 master weights: finite, close to the unquantized layer."""
    torch.manual_seed(0)
    cfg = dict(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=2, aux_loss="none", init_std=0.05)
    fp8 = MoELayer(MoEConfig(**cfg, fp8=Fp8Config())).cuda()
    ref = MoELayer(MoEConfig(**cfg)).cuda()
    ref.load_state_dict(fp8.state_dict())
    x = torch.randn(512, H, device="cuda")
    out = []
    for layer in (fp8, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        out.append((y.float(), layer.experts.w13.grad, layer.experts.w2.grad))
    for a, b in zip(out[0], out[1]):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 1.2e-1
