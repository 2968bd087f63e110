"""Rotary embedding on CPU: the torch expression, its shapes and errors (the kernel: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.transformer import apply_rope, rope_at_positions, rope_tables
from lightning_moe.ops.rope import rope


def test_rope_on_bsnd_equals_apply_rope_on_bnsd() -> None:
    torch.manual_seed(0)
    cos, sin = rope_tables(9, 16, 500.0, torch.device("cpu"))
    x_BSND = torch.randn(2, 9, 3, 16)
    got = rope(x_BSND, cos, sin)
    want = apply_rope(x_BSND.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(got, want)


def test_per_token_tables_rotate_each_row_by_its_positions() -> None:
    torch.manual_seed(0)
    pos_BS = torch.tensor([[0, 1, 2, 0, 1], [4, 3, 2, 1, 0]])
    cos, sin = rope_at_positions(pos_BS, 8, 100.0)
    x = torch.randn(2, 5, 2, 8)
    got = rope(x, cos, sin)
    shared_cos, shared_sin = rope_tables(5, 8, 100.0, torch.device("cpu"))
    # Row 0, token 3 sits at position 0: no rotation.
    assert torch.equal(got[0, 3], x[0, 3])
    # Row 1, token 0 sits at position 4: the shared table's row 4.
    assert torch.equal(got[1, 0], rope(x[1:, 0:1].clone(), shared_cos[4:5], shared_sin[4:5])[0, 0])


@pytest.mark.parametrize("shape,table", [((2, 4, 3, 7), (4, 3)), ((2, 4, 3, 8), (5, 4)), ((4, 3, 8), (4, 4))])
def test_bad_shapes_are_named(shape, table) -> None:
    with pytest.raises(ValueError, match="rope:"):
        rope(torch.randn(*shape), torch.randn(*table), torch.randn(*table))


def test_qk_norm_rope_on_cpu_is_the_norm_then_rope() -> None:
    from torch import nn

    from lightning_moe.ops.qk_norm_rope import qk_norm_rope

    torch.manual_seed(0)
    norm = nn.RMSNorm(16, eps=1e-6)
    cos, sin = rope_tables(5, 16, 100.0, torch.device("cpu"))
    x = torch.randn(2, 5, 3, 16)
    assert torch.equal(qk_norm_rope(x, norm, cos, sin), rope(norm(x), cos, sin))
