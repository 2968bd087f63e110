"""parallel/grad.py on plain (non-DTensor) gradients: the clipping arithmetic, hand-worked."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.parallel.grad import clip_grad_norm_, clip_grad_value_, grad_norm


def _params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


def test_clip_grad_norm_leaves_gradients_below_max_norm_unchanged() -> None:
    params = _params_with_grads([3.0], [4.0])  # global norm 5
    total = clip_grad_norm_(params, max_norm=10.0)
    assert float(total) == pytest.approx(5.0, abs=1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0]), rtol=0, atol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([4.0]), rtol=0, atol=0)


def test_clip_grad_norm_scales_gradients_above_max_norm_to_max_norm() -> None:
    params = _params_with_grads([3.0], [4.0])
    total = clip_grad_norm_(params, max_norm=1.0)
    assert float(total) == pytest.approx(5.0, abs=1e-6)  # the norm before clipping
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params[1].grad, torch.tensor([0.8]), rtol=1e-5, atol=1e-6)
    assert float(grad_norm(params)) == pytest.approx(1.0, abs=1e-5)


def test_clip_grad_value_clamps_both_signs_and_skips_missing_grads() -> None:
    params = _params_with_grads([-3.0, 0.5, 2.0])
    no_grad = torch.nn.Parameter(torch.zeros(2))
    clip_grad_value_([*params, no_grad], clip_value=1.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([-1.0, 0.5, 1.0]), rtol=0, atol=0)
    assert no_grad.grad is None
