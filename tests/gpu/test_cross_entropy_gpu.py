"""The cross-entropy kernel (csrc/cross_entropy.cu) against fp32 ``F.cross_entropy``, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.ops.cross_entropy import token_cross_entropy, token_cross_entropy_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe.ops.build import load_extension  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def ops():
    return load_extension(mode="csrc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,V", [(64, 32768), (7, 1001), (1, 3), (300, 256), (5, 151936)])
def test_matches_fp32_cross_entropy_with_ignored_tokens(dtype, T, V) -> None:
    torch.manual_seed(0)
    logits = (4 * torch.randn(T, V, device=DEV)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (T,), device=DEV)
    labels[::3] = -100
    ref_logits = logits.detach().clone().requires_grad_(True)
    loss = token_cross_entropy(logits, labels)
    assert loss.grad_fn is not None and "TokenCrossEntropy" in type(loss.grad_fn).__name__
    ref = token_cross_entropy_reference(ref_logits, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # fp32 math from the same inputs
    assert torch.all(loss[::3] == 0)
    g = torch.rand(T, device=DEV)
    loss.backward(g)
    ref.backward(g)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=TOL[dtype], atol=TOL[dtype] * g.max().item() / V + 1e-7)
    assert torch.all(logits.grad[::3] == 0)


def test_mean_loss_through_lm_cross_entropy_matches_torch() -> None:
    from torch import nn

    from lightning_moe.parallel.vocab import lm_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(2, 16, 500, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 500, (2, 16), device=DEV)
    labels[0, :5] = -100
    got = lm_cross_entropy(nn.Identity(), logits, labels)
    want = F.cross_entropy(logits.detach().flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_extreme_logits_and_bad_labels() -> None:
    logits = torch.tensor([[1e4, -1e4, 0.0], [float("-inf"), 0.0, 0.0]], device=DEV)
    loss = token_cross_entropy(logits, torch.tensor([1, 0], device=DEV))
    assert loss[0].item() == pytest.approx(2e4) and loss[1].item() == float("inf")
    bad = token_cross_entropy(torch.randn(2, 3, device=DEV), torch.tensor([5, 0], device=DEV))
    assert torch.isnan(bad[0]) and torch.isfinite(bad[1])
