"""The fused RMSNorm swapped into HF models, on the GPU: bf16 within one rounding of transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers")

from lightning_moe.models.hf_norms import FusedRMSNorm, hf_rms_norm_reference  # noqa: E402


@pytest.mark.parametrize("shape", [(4096, 2048), (3, 77, 128), (1, 8), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_norm_matches_transformers_on_cuda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = nn.Parameter((torch.randn(shape[-1], device="cuda") * 0.5 + 1.0).to(dtype))
    fused = FusedRMSNorm(weight, 1e-6)
    x = (torch.randn(shape, device="cuda") * 3.0).to(dtype)
    x_ref, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    y_ref = hf_rms_norm_reference(x_ref, w_ref, 1e-6)
    y_fused = fused(x_fused)
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    assert y_fused.dtype == dtype and bool(torch.isfinite(y_fused).all())
    torch.testing.assert_close(y_fused, y_ref, **tol)
    dy = torch.randn(shape, device="cuda").to(dtype)
    (y_ref.float() * dy.float()).sum().backward()
    (y_fused.float() * dy.float()).sum().backward()
    # Gradients hold row sums (over H for x, over the tokens for the weight) taken in another order
    # by the fused kernel: tolerances relative to the largest value.
    for got, want in ((x_fused.grad, x_ref.grad), (weight.grad, w_ref.grad)):
        if want.numel() and shape[0]:
            scale = float(want.float().abs().max())
            rtol = 3e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * scale)
