"""MoETransformer shape options: explicit head_dim and Qwen3-style q/k norm."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, TransformerConfig


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
