"""The fused query/key RMSNorm + rotary kernel (csrc/qk_norm_rope.cu) against a float64 reference and
against the unfused pair (``nn.RMSNorm`` then ``rope``), forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_moe.models.transformer import rope_at_positions, rope_tables
from lightning_moe.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe.ops.build import load_extension  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def ops():
    return load_extension(mode="csrc")


def _reference64(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    c, s = cos.double()[..., None, :], sin.double()[..., None, :]
    n1, n2 = n.chunk(2, dim=-1)
    return torch.cat([n1 * c - n2 * s, n2 * c + n1 * s], dim=-1)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,N,D", [(2, 64, 4, 128), (1, 9, 3, 64), (2, 5, 2, 256), (1, 1, 1, 192), (3, 33, 8, 128)])
@pytest.mark.parametrize("per_token", [False, True])
def test_fused_equals_float64_math_and_the_unfused_pair(dtype, B, S, N, D, per_token) -> None:
    torch.manual_seed(0)
    norm = nn.RMSNorm(D, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D, device=DEV))
    if per_token:
        cos, sin = rope_at_positions(torch.randint(0, 4 * S, (B, S), device=DEV), D, 1e6)
    else:
        cos, sin = rope_tables(S, D, 1e6, DEV)
    x = (3 * torch.randn(B, S, N, D, device=DEV)).to(dtype).requires_grad_(True)
    y = qk_norm_rope(x, norm, cos, sin)
    assert "QkNormRope" in type(y.grad_fn).__name__, "the fused kernel did not run"
    g = torch.randn_like(y)
    (dx, dw) = torch.autograd.grad(y, (x, norm.weight), g)
    # float64 reference of the same math, and its gradients
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    y64 = _reference64(x64, w64, 1e-6, cos, sin)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    _close(y, y64, TOL[dtype])
    _close(dx, dx64, TOL[dtype])
    _close(dw, dw64, 10 * TOL[dtype] if dtype != torch.float32 else 1e-4)  # summed over B*S*N rows
    # the unfused pair: the same function at the dtype's precision
    x2 = x.detach().clone().requires_grad_(True)
    y2 = qk_norm_rope_reference(x2, norm, cos, sin)
    _close(y, y2, 2 * TOL[dtype])


def test_zero_rows_and_determinism() -> None:
    norm = nn.RMSNorm(128, eps=1e-6).to(DEV, torch.bfloat16)
    cos, sin = rope_tables(16, 128, 1e6, DEV)
    x = torch.randn(2, 16, 4, 128, device=DEV, dtype=torch.bfloat16)
    x[0, 3] = 0  # a token whose heads are all zero: y = 0, finite gradients
    x.requires_grad_(True)
    g = torch.randn(2, 16, 4, 128, device=DEV, dtype=torch.bfloat16)
    y = qk_norm_rope(x, norm, cos, sin)
    assert torch.all(y[0, 3] == 0)
    first = torch.autograd.grad(y, (x, norm.weight), g)
    second = torch.autograd.grad(qk_norm_rope(x, norm, cos, sin), (x, norm.weight), g)
    assert all(torch.isfinite(t).all() for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_unsupported_head_dims_take_the_unfused_path() -> None:
    norm = nn.RMSNorm(96).to(DEV)
    cos, sin = rope_tables(8, 96, 1e6, DEV)
    x = torch.randn(1, 8, 2, 96, device=DEV, requires_grad=True)
    y = qk_norm_rope(x, norm, cos, sin)
    assert "QkNormRope" not in type(y.grad_fn).__name__
