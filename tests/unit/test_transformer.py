"""MoETransformer shape options: explicit head_dim and Qwen3-style q/k norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, TransformerConfig
from lightning_moe.models.transformer import Attention, apply_rope, rope_tables


def _cfg(**kw) -> TransformerConfig:  # noqa: ANN003
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2)
    return TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, moe=moe, **kw)


def test_head_dim_defaults_to_hidden_over_heads_and_can_be_set() -> None:
    assert _cfg().head_dim == 8
    model = MoETransformer(_cfg(head_dim=16, num_kv_heads=2, qk_norm=True))
    attn = model.layers[0].attn
    assert attn.q_proj.out_features == 64 and attn.k_proj.out_features == 32 and attn.o_proj.in_features == 64
    assert attn.q_norm.weight.shape == (16,)
    logits = model(torch.randint(0, 64, (2, 5)))
    assert logits.shape == (2, 5, 64)


def test_qk_norm_normalises_each_head_of_queries_and_keys() -> None:
    torch.manual_seed(0)
    model = MoETransformer(_cfg(qk_norm=True))
    attn = model.layers[0].attn
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, a, out: seen.setdefault("q", out))
    model(torch.randint(0, 64, (1, 3)))
    rms = seen["q"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [3, 1])
def test_odd_or_tiny_head_dim_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match=f"head_dim={bad}"):
        _cfg(head_dim=bad)


# ---- RoPE, causal GQA attention and parameter counting against plain references ------------------


def _rope_reference(x_BNSD: torch.Tensor, theta: float) -> torch.Tensor:
    """Pair ``(x[i], x[i + D/2])`` as the complex number ``x[i] + j x[i + D/2]`` and turn it by
    ``s * theta^(-2i/D)`` at position ``s`` (float64)."""
    S, D = x_BNSD.shape[-2], x_BNSD.shape[-1]
    half = D // 2
    freq = torch.tensor([theta ** (-2.0 * i / D) for i in range(half)], dtype=torch.float64)
    angle_SD = torch.arange(S, dtype=torch.float64)[:, None] * freq[None, :]
    z = torch.complex(x_BNSD[..., :half].double(), x_BNSD[..., half:].double()) * torch.polar(
        torch.ones_like(angle_SD), angle_SD
    )
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_turns_each_half_pair_by_position_times_its_frequency() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)  # B, N, S, D
    cos_SD, sin_SD = rope_tables(7, 8, 500.0, torch.device("cpu"))
    assert cos_SD.shape == (7, 4) and sin_SD.shape == (7, 4)
    torch.testing.assert_close(apply_rope(x, cos_SD, sin_SD).double(), _rope_reference(x, 500.0), atol=1e-5, rtol=1e-5)


def _attention_reference(attn: Attention, x_BSH: torch.Tensor, theta: float) -> torch.Tensor:
    """Causal softmax attention written out: kv heads repeated per query group, mask above the diagonal."""
    B, S, _ = x_BSH.shape
    D, N, KV = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q = (x_BSH @ attn.q_proj.weight.t()).view(B, S, N, D).transpose(1, 2)
    k = (x_BSH @ attn.k_proj.weight.t()).view(B, S, KV, D).transpose(1, 2)
    v = (x_BSH @ attn.v_proj.weight.t()).view(B, S, KV, D).transpose(1, 2).double()
    q, k = _rope_reference(q, theta), _rope_reference(k, theta)
    k, v = k.repeat_interleave(N // KV, dim=1), v.repeat_interleave(N // KV, dim=1)  # query head h reads kv h // (N/KV)
    scores = q @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, N * D)
    return out @ attn.o_proj.weight.t().double()


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa_2_kv_heads", "mqa"])
def test_attention_matches_causal_softmax_reference_with_grouped_kv_heads(num_kv_heads: int | None) -> None:
    torch.manual_seed(0)
    cfg = _cfg(num_kv_heads=num_kv_heads, rope_theta=100.0)
    attn = Attention(cfg)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)  # large enough that attention is far from uniform
    x = torch.randn(2, 6, 32)
    cos_SD, sin_SD = rope_tables(6, cfg.head_dim, cfg.rope_theta, x.device)
    expected = _attention_reference(attn, x, 100.0)
    torch.testing.assert_close(attn(x, cos_SD, sin_SD).double(), expected, atol=1e-5, rtol=1e-4)


def test_attention_output_at_a_position_ignores_later_tokens() -> None:
    torch.manual_seed(0)
    cfg = _cfg(num_kv_heads=2)
    attn = Attention(cfg)
    x = torch.randn(1, 6, 32)
    x_future_changed = x.clone()
    x_future_changed[:, 4:] = torch.randn(1, 2, 32)
    cos_SD, sin_SD = rope_tables(6, cfg.head_dim, cfg.rope_theta, x.device)
    y, y_changed = attn(x, cos_SD, sin_SD), attn(x_future_changed, cos_SD, sin_SD)
    torch.testing.assert_close(y_changed[:, :4], y[:, :4], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y_changed[:, 4:], y[:, 4:])


def test_num_active_params_counts_top_k_of_the_experts_and_skips_embeddings() -> None:
    # num_dense_layers=1: layer 0 dense (ffn 24), layer 1 MoE with 4 experts of ffn 16, top-2.
    model = MoETransformer(_cfg(num_dense_layers=1, dense_ffn_hidden_size=24))
    attn = 4 * 32 * 32  # q, k, v, o: 32 x 32 each (4 heads of 8)
    norms = 2 * 32  # attention and ffn norm of one block
    dense = 3 * 32 * 24
    experts_active = 2 * (32 * 2 * 16 + 16 * 32)  # top-2 of w13 [H, 2F] + w2 [F, H] per expert
    router = 4 * 32
    expected = 2 * (attn + norms) + dense + experts_active + router + 32 + 64 * 32  # + final norm + lm_head
    assert model.num_active_params() == expected


def test_num_kv_heads_that_does_not_divide_num_heads_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        _cfg(num_kv_heads=3)


def test_an_empty_micro_batch_runs_forward_and_backward() -> None:
    """B = 0 (a rank's share of an uneven last batch): attention infers no head count from no elements."""
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, pre_softmax=True)
    model = MoETransformer(TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             moe=moe, max_seq_len=16))  # fmt: skip
    logits = model(torch.zeros(0, 8, dtype=torch.long))
    assert logits.shape == (0, 8, 64)
    logits.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
