"""Packed-document attention: ``attend`` and the transformer against each document run alone."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, TransformerConfig
from lightning_moe.models import attention as attention_mod
from lightning_moe.models.attention import attend, causal_document_mask, cu_seqlens_from_document_ids
from lightning_moe.models.transformer import document_positions, rope_at_positions, rope_tables

from _attention_reference import DOCS, B, D, N, NK, S, grads, inputs, per_document, reference


def test_causal_document_mask_reads_earlier_keys_of_the_same_document() -> None:
    docs = torch.tensor([[0, 0, 1, 1]])
    pos = torch.arange(4)
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_document_mask(docs, docs, pos, pos)[0], want)
    # positions restarting at each document give the same mask within contiguous documents
    assert torch.equal(causal_document_mask(docs, docs, document_positions(docs), document_positions(docs))[0], want)
    assert torch.equal(causal_document_mask(None, None, pos, pos)[0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_attend_with_documents_equals_each_document_alone(backend: str) -> None:
    q, k, v, c = inputs()
    want = grads(lambda q, k, v: per_document(q, k, v, DOCS), q, k, v, c)
    if backend == "flex":  # torch's flex_attention has no CPU backward: compare outputs only
        with torch.no_grad():
            got = attend(q, k, v, document_ids=DOCS, backend="flex")
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
        return
    got = grads(lambda q, k, v: attend(q, k, v, document_ids=DOCS, backend=backend), q, k, v, c)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward runs on CUDA, not on CPU")
def test_flex_gradients_with_documents_equal_each_document_alone_on_cuda() -> None:
    q, k, v, c = (t.cuda() for t in inputs())
    docs = DOCS.cuda()
    want = grads(lambda q, k, v: per_document(q, k, v, docs), q, k, v, c)
    got = grads(lambda q, k, v: attend(q, k, v, document_ids=docs, backend="flex"), q, k, v, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_attend_without_documents_is_plain_causal_attention_and_positions_decide_order() -> None:
    q, k, v, c = inputs(1)
    one_doc = torch.zeros(B, S, dtype=torch.long)
    want = grads(lambda q, k, v: per_document(q, k, v, one_doc), q, k, v, c)
    for kw in ({}, {"document_ids": one_doc}, {"positions_q": torch.arange(S), "positions_k": torch.arange(S)}):
        got = grads(lambda q, k, v, kw=kw: attend(q, k, v, backend="sdpa", **kw), q, k, v, c)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # reversed positions: token s reads the keys at and after s
    rev = torch.arange(S - 1, -1, -1)
    flipped = attend(q.flip(2), k.flip(2), v.flip(2), backend="sdpa").flip(2)
    torch.testing.assert_close(attend(q, k, v, positions_q=rev, positions_k=rev, backend="sdpa"), flipped)


def test_every_token_its_own_document_reads_only_itself() -> None:
    q, k, v, _ = inputs(2)
    docs = torch.arange(S).expand(B, S)
    for backend in ("sdpa", "flex"):
        with torch.no_grad():
            out = attend(q, k, v, document_ids=docs, backend=backend)
        torch.testing.assert_close(out, v.repeat_interleave(N // NK, dim=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex"])
def test_empty_batch_gives_an_empty_output(backend: str) -> None:
    q, k, v, _ = inputs(b=0)
    docs = torch.zeros(0, S, dtype=torch.long)
    with torch.no_grad():
        assert attend(q, k, v, document_ids=docs, backend=backend).shape == (0, N, S, D)


def test_cu_seqlens_cut_at_each_document_and_each_row() -> None:
    cu, max_len = cu_seqlens_from_document_ids(DOCS)
    assert cu.tolist() == [0, 4, 5, 11, 13, 26] and cu.dtype == torch.int32 and max_len == 13
    cu, max_len = cu_seqlens_from_document_ids(torch.zeros(0, 5, dtype=torch.long))
    assert cu.tolist() == [0] and max_len == 0


def test_flash_varlen_layout_equals_each_document_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The varlen call (flattened rows, cu_seqlens, GQA heads) with a reference kernel in its place."""
    calls = []

    def fake_varlen(q_TND, k_TND, v_TND, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):  # noqa: ANN001, ANN202
        calls.append((cu_q.tolist(), max_q, causal))
        out = torch.empty_like(q_TND)
        for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            out[lo:hi] = reference(q_TND[lo:hi].transpose(0, 1), k_TND[lo:hi].transpose(0, 1), v_TND[lo:hi].transpose(0, 1)).transpose(0, 1)
        return out

    monkeypatch.setattr(attention_mod, "_flash_varlen_fn", lambda: fake_varlen)
    q, k, v, _ = inputs(3)
    got = attention_mod._attend_flash_varlen(q, k, v, DOCS, None)
    torch.testing.assert_close(got, per_document(q, k, v, DOCS), rtol=1e-5, atol=1e-5)
    assert calls == [([0, 4, 5, 11, 13, 26], 13, True)]


def test_unavailable_backends_chosen_explicitly_are_refused_with_the_fix() -> None:
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="backend='flash_varlen' needs the flash_attn package.*choose attention_backend='varlen'"):
        attend(q, k, v, document_ids=DOCS, backend="flash_varlen")
    with pytest.raises(ValueError, match="backend='flex' runs on CPU in forward only"):
        attend(q.requires_grad_(True), k, v, document_ids=DOCS, backend="flex")
    with pytest.raises(ValueError, match="backend='best' is unknown"):
        attend(q, k, v, backend="best")
    with pytest.raises(ValueError, match=r"document_ids \(queries\) must be an integer \[2, 13\]"):
        attend(q, k, v, document_ids=DOCS[:, :5], backend="sdpa")


# ---- the transformer -------------------------------------------------------------------------


def _cfg(**kw) -> TransformerConfig:  # noqa: ANN003
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss_coeff=0.0)
    return TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, moe=moe, **kw)


def test_rope_at_positions_are_rows_of_the_table() -> None:
    cos_SD, sin_SD = rope_tables(32, 8, 100.0, torch.device("cpu"))
    pos = torch.tensor([[0, 5, 31, 2], [1, 1, 0, 30]])
    cos_BSD, sin_BSD = rope_at_positions(pos, 8, 100.0)
    assert torch.equal(cos_BSD, cos_SD[pos]) and torch.equal(sin_BSD, sin_SD[pos])


def test_document_positions_restart_at_each_document() -> None:
    assert document_positions(DOCS[:1]).tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert document_positions(DOCS[1:]).tolist() == [list(range(13))]


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_packed_transformer_equals_each_document_through_the_model_alone(backend: str) -> None:
    torch.manual_seed(0)
    model = MoETransformer(_cfg(attention_backend=backend))
    ids = torch.randint(0, 64, (B, S))
    c = torch.randn(B, S, 64)
    logits = model(ids, document_ids_BS=DOCS)
    (logits * c).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b in range(B):
        for doc in DOCS[b].unique():
            idx = (DOCS[b] == doc).nonzero().flatten()
            alone = model(ids[b : b + 1, idx])
            torch.testing.assert_close(logits[b : b + 1, idx], alone, rtol=1e-5, atol=1e-5)
            total = total + (alone * c[b : b + 1, idx]).sum()
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # explicit positions equal to the derived ones give the same logits
    torch.testing.assert_close(model(ids, document_positions(DOCS), DOCS), logits)


def test_transformer_refuses_decreasing_documents_and_bad_ids() -> None:
    model = MoETransformer(_cfg(max_seq_len=16))
    ids = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match=r"document_ids_BS decrease in row 0 at token 3 \(2 -> 1\)"):
        model(ids, document_ids_BS=torch.tensor([[0, 0, 2, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"position_ids_BS span \[0, 16\], outside \[0, max_seq_len=16\)"):
        model(ids, position_ids_BS=torch.tensor([[0, 1, 2, 3, 4, 16]]))
    with pytest.raises(ValueError, match=r"document_ids_BS has shape \(1, 5\)"):
        model(ids, document_ids_BS=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="document_ids_BS must be an integer tensor"):
        model(ids, document_ids_BS=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="attention_backend='fast' is unknown"):
        _cfg(attention_backend="fast")


def test_empty_batch_with_documents_runs() -> None:
    model = MoETransformer(_cfg())
    empty = torch.zeros(0, S, dtype=torch.long)
    logits = model(empty, document_ids_BS=empty)
    assert logits.shape == (0, S, 64)
    logits.sum().backward()


@pytest.mark.parametrize("recompute", [["attn"], ["block"]])
def test_recompute_with_documents_equals_keeping_everything(recompute: list[str]) -> None:
    torch.manual_seed(0)
    kept = MoETransformer(_cfg())
    rebuilt = MoETransformer(_cfg(recompute=recompute))
    rebuilt.load_state_dict(kept.state_dict())
    ids, c = torch.randint(0, 64, (B, S)), torch.randn(B, S, 64)
    for model in (kept, rebuilt):
        (model(ids, document_ids_BS=DOCS) * c).sum().backward()
    for (name, a), b in zip(kept.named_parameters(), rebuilt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
