"""``weighted_swiglu`` (the public autograd function) against plain PyTorch autograd.

Legend: R rows, F expert FFN width; ``h_R2F = [gate | up]``, ``a_RF = silu(gate) * up * w_R``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.ops.swiglu import weighted_swiglu

ATOL, RTOL = 1e-6, 1e-5  # fp32, O(1) values, one product of three factors per element


def _plain_weighted_swiglu(h_R2F: torch.Tensor, w_R: torch.Tensor) -> torch.Tensor:
    gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
    return F.silu(gate_RF) * up_RF * w_R.unsqueeze(-1)


@pytest.mark.parametrize(
    ("h_grad", "w_grad"), [(True, True), (False, True), (True, False)], ids=["both", "weights_only", "rows_only"]
)
def test_weighted_swiglu_gradients_match_autograd_for_each_input_that_requires_them(h_grad: bool, w_grad: bool) -> None:
    """Every input that requires a gradient gets autograd's, also when the other one does not
    (frozen experts upstream of ``h``: the router still needs ``grad_w``)."""
    g = torch.Generator().manual_seed(0)
    R, FF = 7, 6
    h = torch.randn(R, 2 * FF, generator=g)
    w = torch.rand(R, generator=g) + 0.1
    grad_a = torch.randn(R, FF, generator=g)

    h_a, w_a = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
    a = weighted_swiglu(h_a, w_a)
    a.backward(grad_a)
    h_r, w_r = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
    a_ref = _plain_weighted_swiglu(h_r, w_r)
    a_ref.backward(grad_a)

    torch.testing.assert_close(a, a_ref, atol=ATOL, rtol=RTOL)
    for got, ref, needed in ((h_a.grad, h_r.grad, h_grad), (w_a.grad, w_r.grad, w_grad)):
        if needed:
            assert got is not None
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
        else:
            assert got is None
