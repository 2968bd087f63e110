"""Every CUDA attention backend on packed bf16 rows against a float64 reference on the CPU.

Rows with skewed document lengths (one long document beside many 1-token ones, a row that is one
document, a row of 1-token documents), grouped-query heads (N = 4 x Nk), forward and the three
input gradients. Errors are measured relative to the largest magnitude of the reference tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from lightning_moe.models import attention as attention_mod
from lightning_moe.models.attention import attend, causal_document_mask, resolve_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

N, NK, D = 16, 4, 128
REL_TOL = 2e-2  # bf16 attention: max |error| / max |reference| per tensor


def _document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def _layouts(s: int) -> dict[str, torch.Tensor]:
    long_then_ones = [s - 40, *([1] * 40)]
    ones_then_long = [*([1] * 33), 7, s - 40]
    return {
        "skewed": _document_ids([long_then_ones, ones_then_long]),
        "one_document_rows": _document_ids([[s], [s]]),
        "all_single_tokens": _document_ids([[1] * s, [s // 2, s - s // 2]]),
    }


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Float64 math attention on the CPU with ``causal_document_mask``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pos = torch.arange(q.shape[2])
    mask_B1QK = causal_document_mask(docs, docs, pos, pos)[:, None]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask_B1QK, float("-inf")).softmax(-1) @ v


def _out_and_grads(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad((out * c).sum(), leaves))


def _cuda_backends() -> list[str]:
    names = ["sdpa", "flex"]
    if attention_mod._torch_varlen_fn() is not None:
        names.append("varlen")
    if attention_mod._flash_varlen_fn() is not None:
        names.append("flash_varlen")
    return names


@pytest.mark.parametrize("layout", ["skewed", "one_document_rows", "all_single_tokens"])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen", "flash_varlen"])
def test_backend_forward_and_backward_equal_the_float64_reference(backend: str, layout: str) -> None:
    if backend not in _cuda_backends():
        pytest.skip(f"backend {backend!r} does not import here")
    s = 512
    docs = _layouts(s)[layout]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, N, s, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, NK, s, D, generator=g, dtype=torch.float64)
    v = torch.randn(2, NK, s, D, generator=g, dtype=torch.float64)
    c = torch.randn(2, N, s, D, generator=g, dtype=torch.float64)
    want = _out_and_grads(lambda q, k, v: _reference(q, k, v, docs), q, k, v, c)
    dev = [t.to("cuda", torch.bfloat16) for t in (q, k, v, c)]
    docs_dev = docs.cuda()
    got = _out_and_grads(lambda q, k, v: attend(q, k, v, document_ids=docs_dev, backend=backend), *dev)
    for name, g_, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g_.shape == w.shape, name
        err = (g_.double().cpu() - w).abs().max() / w.abs().max().clamp(min=1e-12)
        assert err < REL_TOL, f"{backend} {layout} {name}: max error {err:.3e} of the largest value (tol {REL_TOL})"


def test_auto_picks_a_kernel_that_skips_other_documents_for_packed_bf16_rows() -> None:
    chosen = resolve_backend("auto", torch.device("cuda"), torch.bfloat16, packed=True, positioned=False, head_dim=D)
    want = "flash_varlen" if attention_mod._flash_varlen_fn() is not None else None
    if want is None and attention_mod._torch_varlen_unavailable_reason(torch.device("cuda"), D) is None:
        want = "varlen"
    assert chosen == (want or "flex")
    unpacked = resolve_backend("auto", torch.device("cuda"), torch.bfloat16, packed=False, positioned=False)
    assert unpacked == "sdpa"


def test_torch_varlen_runs_on_this_gpu() -> None:
    """On a GPU of compute capability 8.0 or newer with a torch that ships varlen_attn, ``auto``
    must not fall back to flex or sdpa for packed rows."""
    if attention_mod._torch_varlen_fn() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's flash kernel needs compute capability 8.0")
    assert attention_mod._torch_varlen_unavailable_reason(torch.device("cuda"), D) is None


def test_packed_transformer_with_auto_equals_the_masked_sdpa_model() -> None:
    """The whole model on packed bf16 rows: ``auto`` (a varlen or flex kernel here) against the
    same weights with ``sdpa`` and a dense mask, logits and every parameter gradient."""
    from lightning_moe import MoEConfig
    from lightning_moe.models import MoETransformer, TransformerConfig

    def build(backend: str) -> MoETransformer:
        torch.manual_seed(0)
        # every token reaches every expert: a rounding difference cannot flip a routing decision
        moe = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=4, top_k=4, aux_loss_coeff=0.0)
        cfg = TransformerConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, moe=moe,
                                max_seq_len=512, attention_backend=backend)  # fmt: skip
        with torch.device("cuda"):
            return MoETransformer(cfg).to(torch.bfloat16)

    s = 512
    docs = _layouts(s)["skewed"].cuda()
    ids = torch.randint(0, 512, (2, s), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    for backend in ("auto", "sdpa"):
        model = build(backend)
        logits = model(ids, document_ids_BS=docs)
        logits.float().square().mean().backward()
        runs[backend] = (logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()})
    (got, got_grads), (want, want_grads) = runs["auto"], runs["sdpa"]
    assert (got - want).abs().max() / want.abs().max() < 3e-2
    for name, g in got_grads.items():
        w = want_grads[name]
        err = (g - w).abs().max() / w.abs().max().clamp(min=1e-12)
        assert err < 5e-2, f"{name}: max error {err:.3e} of the largest gradient"
