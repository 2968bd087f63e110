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
    "kernel", ["auto", "loop", "streams", "streams:3,1", "streams:3,3", "cutlass"]
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_wgrad_accumulation_matches_autograd_accumulation(dtype, tol, kernel, monkeypatch) -> None:  # noqa: ANN001
    """Three accumulated backward passes: .grad += inside the wgrad GEMMs equals autograd's addition."""
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
    else:
        expected = kernel
    assert taken == [expected] * 4
    for name in grads[0]:
        assert _rel(grads[1][name], grads[0][name]) <= tol, name
