"""Context parallelism in one process: sharding, the CP attention math on a group of one, what it
keeps for backward (a fake 4-rank group), and ``enable_context_parallel`` on our transformer.

The multi-rank results (CP=2 and CP=4 equal one process) are in ``tests/dist/test_dist_context.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _saved_bytes import saved_bytes

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, TransformerConfig
from lightning_moe.models.context_parallel import enable_context_parallel
from lightning_moe.models.transformer import document_positions
from lightning_moe.parallel.context import (
    context_parallel_attention,
    cp_chunk_positions,
    shard_sequence,
    unshard_sequence,
)

B, N, NK, S, D = 2, 4, 2, 16, 8
DOCS = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [5] * 16])


def _reference(q, k, v, docs=None):  # noqa: ANN001, ANN202
    """Causal (same-document) softmax attention over the whole sequence, written out."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if docs is not None:
        keep = keep & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep[:, None], float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(seed: int, b: int = B, s: int = S, n: int = N, nk: int = NK, d: int = D) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) * (2 if i < 2 else 1) for i, h in enumerate((n, nk, nk, n))]


def _run(fn, q, k, v, c):  # noqa: ANN001, ANN202
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad((out * c).sum(), leaves)]


# ---- sharding ----------------------------------------------------------------------------------


def test_each_rank_holds_an_early_and_the_mirrored_late_chunk() -> None:
    assert cp_chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([cp_chunk_positions(48, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))
    assert cp_chunk_positions(0, 4, 3).numel() == 0


def test_shard_then_unshard_gives_the_sequence_back() -> None:
    x = torch.randn(3, 24, 5)
    for cp in (1, 2, 3):
        shards = [shard_sequence(x, cp, r) for r in range(cp)]
        assert all(s.shape == (3, 24 // cp, 5) for s in shards)
        assert torch.equal(unshard_sequence(shards, cp), x)
    assert torch.equal(shard_sequence(x, 2, 1, dim=1), x[:, cp_chunk_positions(24, 2, 1)])


def test_bad_lengths_and_ranks_are_refused_naming_the_multiple() -> None:
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*cp=4.*e\.g\. 12"):
        cp_chunk_positions(10, 2, 0)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2\*cp=8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 must be in \[0, cp_size=2\)"):
        cp_chunk_positions(8, 2, 2)
    with pytest.raises(ValueError, match="got 1 shards for cp_size=2"):
        unshard_sequence([torch.zeros(1, 4)], 2)


# ---- the math on one rank ----------------------------------------------------------------------


@pytest.mark.parametrize("nk", [NK, N, 1], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_cp_attention_on_one_rank_equals_full_attention(nk: int, documents: bool) -> None:
    q, k, v, c = _inputs(0, nk=nk)
    docs = DOCS if documents else None
    want = _run(lambda q, k, v: _reference(q, k, v, docs), q, k, v, c)
    positions = [torch.arange(S)] + ([document_positions(DOCS)] if documents else [])  # global or restarting
    for pos in positions:
        got = _run(lambda q, k, v, pos=pos: context_parallel_attention(q, k, v, pos, None, docs), q, k, v, c)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_cp_attention_in_small_blocks_and_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.parallel.context as context

    q, k, v, c = _inputs(1)
    want = _run(lambda q, k, v: _reference(q, k, v, DOCS), q, k, v, c)
    monkeypatch.setattr(context, "_BLOCK_ELEMENTS", 1)  # one query per block
    got = _run(lambda q, k, v: context_parallel_attention(q, k, v, torch.arange(S), None, DOCS), q, k, v, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    got = _run(lambda q, k, v: context_parallel_attention(q, k, v, torch.arange(S), None, DOCS), q.bfloat16(), k.bfloat16(), v.bfloat16(), c.bfloat16())
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=5e-2, atol=5e-2)


def test_cp_attention_takes_head_major_views_of_token_major_projections() -> None:
    q, k, v, c = _inputs(4)
    want = _run(lambda q, k, v: _reference(q, k, v, DOCS), q, k, v, c)

    def token_major(q, k, v):  # noqa: ANN001, ANN202 - [B, S, N, D] storage seen as [B, N, S, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
        return context_parallel_attention(q, k, v, torch.arange(S), None, DOCS)

    for g, w in zip(_run(token_major, q, k, v, c), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_cp_attention_with_an_empty_batch_runs_forward_and_backward() -> None:
    q, k, v, c = _inputs(2, b=0)
    got = _run(lambda q, k, v: context_parallel_attention(q, k, v, torch.arange(S), None, torch.zeros(0, S, dtype=torch.long)), q, k, v, c)
    assert [g.shape for g in got] == [(0, N, S, D), (0, N, S, D), (0, NK, S, D), (0, NK, S, D)]


def test_cp_attention_refuses_mismatched_inputs() -> None:
    q, k, v, _ = _inputs(3)
    with pytest.raises(ValueError, match=r"positions_s must be an integer \[16\] or \[2, 16\]"):
        context_parallel_attention(q, k, v, torch.arange(8), None)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3"):
        context_parallel_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), torch.arange(S), None)
    with pytest.raises(ValueError, match=r"document_ids_Bs must be an integer \[2, 16\]"):
        context_parallel_attention(q, k, v, torch.arange(S), None, DOCS[:, :4])
    with pytest.raises(TypeError, match="cp_group='world' must be a torch.distributed ProcessGroup"):
        context_parallel_attention(q, k, v, torch.arange(S), "world")


# ---- what it keeps for backward ----------------------------------------------------------------


def test_cp4_keeps_at_most_a_third_of_one_rank_for_backward_at_8k(fake_world) -> None:  # noqa: ANN001
    """S=8192, 2 heads x 16: one rank of a (fake, data-free) 4-rank group against the whole sequence on one."""
    seq, heads, dim = 8192, 2, 16
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    cp1 = saved_bytes(lambda q, k, v: context_parallel_attention(q, k, v, torch.arange(seq), None), q, k, v)
    fake_world(0, 4)
    pos = cp_chunk_positions(seq, 4, 0)
    ql, kl, vl = (t.detach()[:, :, pos].requires_grad_(True) for t in (q, k, v))
    cp4 = saved_bytes(lambda q, k, v: context_parallel_attention(q, k, v, pos, dist.group.WORLD), ql, kl, vl)
    assert cp1 >= 4 * 1 * heads * seq * dim * 4  # q, k, v and the output at least
    assert cp4 <= 0.35 * cp1, (cp4, cp1)


# ---- the transformer under a CP group ----------------------------------------------------------


def _cfg() -> TransformerConfig:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss_coeff=0.0)
    return TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, moe=moe)


def test_transformer_on_a_cp_group_of_one_equals_the_plain_model(fake_world) -> None:  # noqa: ANN001
    fake_world(0, 1)
    torch.manual_seed(0)
    plain = MoETransformer(_cfg())
    cp = copy.deepcopy(plain)
    enable_context_parallel(cp, dist.group.WORLD)
    assert all(layer.attn.cp_group is dist.group.WORLD for layer in cp.layers)
    ids, c = torch.randint(0, 64, (B, S)), torch.randn(B, S, 64)
    for pos, docs in ((torch.arange(S).expand(B, S), None), (document_positions(DOCS), DOCS)):
        want, got = plain(ids, pos, docs), cp(ids, pos, docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (want * c).sum().backward()
        (got * c).sum().backward()
        for (name, a), b in zip(plain.named_parameters(), cp.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        plain.zero_grad(), cp.zero_grad()
    with pytest.raises(ValueError, match="under context parallelism the input is this rank's shard; pass position_ids_BS"):
        cp(ids)
    enable_context_parallel(cp, None)
    assert all(layer.attn.cp_group is None for layer in cp.layers)
    torch.testing.assert_close(cp(ids), plain(ids))


class _LlamaAttention(nn.Module):  # another library's attention, by its name
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_enable_context_parallel_refuses_attention_it_cannot_wrap(fake_world) -> None:  # noqa: ANN001
    fake_world(0, 1)
    ours = MoETransformer(_cfg())
    for extra, kind in ((nn.MultiheadAttention(8, 2), "MultiheadAttention"), (_LlamaAttention(), "_LlamaAttention")):
        model = nn.ModuleDict({"lm": ours, "side": nn.Sequential(nn.Linear(8, 8), extra)})
        with pytest.raises(TypeError, match=rf"module 'side.1' \({kind}\) is attention that context parallelism cannot wrap"):
            enable_context_parallel(model, dist.group.WORLD)
        assert all(layer.attn.cp_group is None for layer in ours.layers)  # nothing changed
    with pytest.raises(ValueError, match="Sequential has no lightning_moe Attention module"):
        enable_context_parallel(nn.Sequential(nn.Linear(2, 2)), dist.group.WORLD)
    with pytest.raises(TypeError, match="cp_group=2 must be a torch.distributed ProcessGroup"):
        enable_context_parallel(ours, 2)
