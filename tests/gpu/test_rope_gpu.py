"""The rotary-embedding kernel (csrc/rope.cu) against the torch expression, forward and backward.

The kernel rounds every product and sum as torch's elementwise kernels do and casts once, so the
forward equals :func:`rope_reference` bit for bit and the backward equals autograd through it.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.transformer import rope_at_positions, rope_tables
from lightning_moe.ops.rope import rope, rope_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the csrc kernels run only there)", allow_module_level=True)

from lightning_moe.ops.build import load_extension  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def ops():
    return load_extension(mode="csrc")  # a failed build raises instead of silently testing torch


def _tables(B: int, S: int, D: int, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not per_token:
        return rope_tables(S, D, 10000.0, DEV)
    pos_BS = torch.randint(0, 4 * S, (B, S), device=DEV)
    return rope_at_positions(pos_BS, D, 10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,N,D", [(2, 64, 4, 128), (1, 7, 3, 6), (3, 33, 2, 64), (1, 1, 1, 2), (2, 16, 8, 80)])
@pytest.mark.parametrize("per_token", [False, True])
def test_rope_equals_the_torch_expression_bitwise(dtype, B, S, N, D, per_token) -> None:
    torch.manual_seed(0)
    cos, sin = _tables(B, S, D, per_token)
    x = torch.randn(B, S, N, D, device=DEV, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = rope(x, cos, sin), rope_reference(x_ref, cos, sin)
    assert out.grad_fn is not None and "Rope" in type(out.grad_fn).__name__, "the kernel path did not run"
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)


def test_rope_reads_a_transposed_view_and_empty_batches() -> None:
    cos, sin = rope_tables(16, 32, 10000.0, DEV)
    x_BNSD = torch.randn(2, 4, 16, 32, device=DEV, dtype=torch.bfloat16)
    x_BSND = x_BNSD.transpose(1, 2)  # not contiguous
    assert torch.equal(rope(x_BSND, cos, sin), rope_reference(x_BSND, cos, sin))
    empty = torch.randn(0, 16, 4, 32, device=DEV, dtype=torch.bfloat16)
    assert rope(empty, cos, sin).shape == empty.shape


def test_rope_op_rejects_bad_tables_naming_the_value(ops) -> None:
    x = torch.randn(10, 2, 8, device=DEV)
    cos = torch.randn(3, 4, device=DEV)
    with pytest.raises(RuntimeError, match="not a multiple of the 3 table rows"):
        ops.rope(x, cos, cos, False)
    with pytest.raises(RuntimeError, match=r"expected \[P, D/2\]"):
        ops.rope(x, torch.randn(10, 5, device=DEV), torch.randn(10, 5, device=DEV), False)
