"""The MoE layer on CUDA: the csrc path equals the torch path (forward and every gradient)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEConfig, MoELayer, resources

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _reread_kernels_mode_after() -> object:
    """Torn down after monkeypatch restored the variable: later tests read this process's own mode."""
    yield
    resources.reread_environment()


def _run(layer: MoELayer, x: torch.Tensor, go: torch.Tensor, mode: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LIGHTNING_MOE_KERNELS", mode)
    resources.reread_environment()  # the mode is read once per process
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(go)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("me", [True, False])
@pytest.mark.parametrize("shape", [(333, 64, 32, 8, 2), (1024, 256, 128, 64, 8), (7, 64, 32, 16, 4)])
def test_csrc_layer_matches_torch_layer(shape, dtype, tol, me, monkeypatch) -> None:  # noqa: ANN001
    T, H, Fh, E, K = shape
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=H, ffn_hidden_size=Fh, num_experts=E, top_k=K, pre_softmax=True,
        aux_loss="switch", z_loss_coeff=1e-3, memory_efficient_permute=me, shared_expert_ffn_size=32,
    )
    layer = MoELayer(cfg).cuda().to(dtype)
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    go = torch.randn(T, H, device="cuda", dtype=dtype)
    y_t, gx_t, g_t = _run(layer, x, go, "torch", monkeypatch)
    y_c, gx_c, g_c = _run(layer, x, go, "csrc", monkeypatch)
    assert _rel(y_c, y_t) <= tol
    assert _rel(gx_c, gx_t) <= tol
    assert g_c.keys() == g_t.keys()
    for name in g_t:
        assert _rel(g_c[name], g_t[name]) <= tol, name


def test_layer_with_capacity_and_padding_runs_on_cuda() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, capacity_factor=1.0,
                    pad_to_capacity=True, pre_softmax=True)
    layer = MoELayer(cfg).cuda()
    x = torch.randn(4, 50, 64, device="cuda", requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_overlap_gives_the_same_numbers(gate: bool) -> None:
    """The shared expert on a side stream (forward and backward) changes the schedule, not the math."""
    torch.manual_seed(0)
    cfg = dict(hidden_size=128, ffn_hidden_size=64, num_experts=16, top_k=4, shared_expert_ffn_size=96,
               shared_expert_gate=gate)  # fmt: skip
    plain = MoELayer(MoEConfig(**cfg)).cuda().to(torch.bfloat16)
    overlapped = MoELayer(MoEConfig(**cfg, shared_expert_overlap=True)).cuda().to(torch.bfloat16)
    overlapped.load_state_dict(plain.state_dict())
    x = torch.randn(4, 300, 128, device="cuda", dtype=torch.bfloat16)
    go = torch.randn_like(x)
    results = []
    for layer in (plain, overlapped):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(go)
        results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert torch.equal(y0, y1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)  # one contribution each: bitwise
    # x's gradient sums three branches (router, experts, shared expert) in the order autograd
    # meets them, which the second stream may change: equal up to bf16 rounding of that sum.
    torch.testing.assert_close(gx1, gx0, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(  # ops/wgrad/; after ":" the stream counts of w13 and w2
    "kernel", ["auto", "loop", "streams", "streams:3,1", "streams:3,3", "triton", "cutlass"]
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_wgrad_accumulation_matches_autograd_accumulation(dtype, tol, kernel, monkeypatch) -> None:  # noqa: ANN001
    """Three accumulated backward passes: .grad += inside the wgrad GEMMs equals autograd's addition."""
    import importlib.util

    import lightning_moe.ops.wgrad as wacc
    import lightning_moe.ops.wgrad.choice as wchoice
    from lightning_moe.config import KernelConfig

    kernel, _, streams = kernel.partition(":")
    w13_streams, w2_streams = map(int, streams.split(",")) if streams else (2, 2)
    kernels = KernelConfig(wgrad=kernel, wgrad_streams_w13=w13_streams, wgrad_streams_w2=w2_streams)
    from lightning_moe.ops.wgrad import cutlass_kernel as wgrad_cutlass

    cutlass_runs = dtype == torch.bfloat16 and wgrad_cutlass.supported(torch.empty(0, device="cuda", dtype=dtype))
    if not (kernel in ("auto", "cutlass") and cutlass_runs):
        # The test shape is narrow: per-expert cuBLAS kernels fuse only for wide experts. (CUTLASS fuses
        # at any width, and ``auto`` must see the real width to choose it.)
        monkeypatch.setattr(wchoice, "wide_experts", lambda w2: True)
    taken: list[str] = []
    original = wacc.WgradFusion.accumulate_
    monkeypatch.setattr(
        wacc.WgradFusion, "accumulate_", lambda self, g, *a: (taken.append(self.kernel), original(self, g, *a))[1]
    )
    torch.manual_seed(0)
    cfg = dict(hidden_size=256, ffn_hidden_size=128, num_experts=32, top_k=4, pre_softmax=True)
    grads = []
    for fuse in (False, True):
        torch.manual_seed(1)
        layer = MoELayer(MoEConfig(**cfg, fuse_wgrad_accumulation=fuse, kernels=kernels)).cuda().to(dtype)
        g = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(3):
            x = torch.randn(500, 256, device="cuda", dtype=dtype, generator=g)
            layer(x).float().pow(2).sum().backward()
        grads.append({n: p.grad.detach().clone() for n, p in layer.named_parameters()})
    assert len(taken) == 4  # w2 and w13 of the second and third passes
    if kernel in ("auto", "cutlass"):
        expected = "cutlass" if cutlass_runs else "streams"  # 32 experts: two streams
    elif kernel == "triton":
        expected = "triton" if importlib.util.find_spec("triton") is not None else "loop"
    else:
        expected = kernel
    assert taken == [expected] * 4
    for name in grads[0]:
        assert _rel(grads[1][name], grads[0][name]) <= tol, name


_TILES = [  # (block_d, block_o, block_r, warps, stages, c_load, programs_per_sm)
    (128, 128, 64, 4, 3, "init", 0),
    (128, 128, 64, 4, 3, "early", 0),
    (64, 128, 32, 4, 4, "late", 0),
    (128, 256, 64, 8, 3, "init", 0),
    (128, 128, 64, 4, 3, "init", 2),
    (128, 128, 64, 4, 3, "tma", 0),  # the 72-wide case falls back to "early"
    (128, 256, 64, 8, 3, "tma", 1),
]


def _wgrad_case(dims: tuple[int, int, int, int], dtype: torch.dtype, seed: int):  # noqa: ANN202
    """Random grouped rows (experts 0 and E-1 empty, 5 rows past the last expert), a gradient to add
    into, and the expected sum computed per expert in float64."""
    rows, D, O, E = dims
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.zeros(E, dtype=torch.long, device="cuda")
    if rows:
        counts += torch.bincount(torch.randint(1, E - 1, (rows,), device="cuda", generator=g), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(rows + 5, D, device="cuda", dtype=dtype, generator=g)
    dy = torch.randn(rows + 5, O, device="cuda", dtype=dtype, generator=g)
    dw = torch.randn(E, D, O, device="cuda", dtype=dtype, generator=g)
    bounds = [0] + offs.tolist()
    want = dw.float().clone()
    for e in range(E):
        want[e] += (x[bounds[e] : bounds[e + 1]].double().t() @ dy[bounds[e] : bounds[e + 1]].double()).float()
    return x, dy, dw, offs, want


def _assert_added(dw: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert torch.equal(dw[0], want[0].to(dw.dtype)) and torch.equal(dw[-1], want[-1].to(dw.dtype))  # empty
    for e in range(dw.shape[0]):
        assert _rel(dw[e], want[e]) <= tol, e


@pytest.mark.parametrize("tile", _TILES, ids=lambda t: "-".join(map(str, t)))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dims", [(700, 256, 384, 12), (333, 72, 200, 5), (0, 128, 128, 3)])
def test_grouped_wgrad_kernel_adds_exactly_the_per_expert_products(dims, dtype, tol, tile) -> None:  # noqa: ANN001
    """Every tile of the Triton kernel: dw[e] += x_e^T dy_e, empty experts untouched, rows past the end ignored."""
    pytest.importorskip("triton")
    from lightning_moe.ops.wgrad.triton_kernel import WgradTile, grouped_wgrad_accumulate_

    if dtype == torch.float32 and tile[5] == "tma" and tile[0] * tile[1] > 128 * 128:
        pytest.skip("an fp32 128x256 tile read through TMA needs more shared memory than the H200 has")
    x, dy, dw, offs, want = _wgrad_case(dims, dtype, seed=dims[0] + dims[1])
    grouped_wgrad_accumulate_(dw, x, dy, offs, WgradTile(*tile))
    _assert_added(dw, want, tol)
