"""A packed row computes what each of its documents computes alone (fp32, one process, EP=1).

Three documents of different lengths are packed into one row (with padding) by
``pack_documents``; every labelled token's loss (our transformer, a plain-PyTorch reference
model) or logits (a tiny random HF model) must equal those of the document run alone, packed in a
row of its own. MoE routing is per token and dropless, so it is unchanged by packing; attention
is what the document ids must confine. Without them the packed row differs (the control case).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.data import pack_documents
from lightning_moe.models.transformer import apply_rope
from lightning_moe.moe.layer import MoELayer

VOCAB, EOS = 64, 0
LENGTHS = (5, 9, 3)  # + one EOS each = 20 tokens in a row of 24: padding at the end
SEQ_LEN = 23


def _documents(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _packed_and_alone(docs: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    packed = pack_documents(docs, SEQ_LEN, EOS)
    assert packed["input_ids"].shape == (1, SEQ_LEN)  # one row holds all three
    assert packed["document_ids"][0].unique().numel() == len(docs) + 1  # and padding
    alone = [pack_documents([d], len(d), EOS) for d in docs]  # a document and its EOS fill a row
    return packed, alone


def _segments(packed: dict[str, torch.Tensor], docs: list[list[int]]) -> list[torch.Tensor]:
    """Input positions of each document's own tokens in the packed row (its EOS input excluded)."""
    doc = packed["document_ids"][0]
    return [(doc == k).nonzero().flatten()[: len(d)] for k, d in enumerate(docs)]


def _token_losses(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), reduction="none")


# --- the data path alone: a plain-PyTorch model with document-masked attention -----------------


class _ReferenceLM(nn.Module):
    """Embedding, one RoPE attention layer (causal within a document), one MoE FFN, a head."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.embed = nn.Embedding(VOCAB, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.moe = MoELayer(MoEConfig(hidden_size=hidden, ffn_hidden_size=16, num_experts=4, top_k=2),
                            layer_name="ffn")  # fmt: skip
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, document_ids_BS: torch.Tensor | None):
        B, S = input_ids_BS.shape
        x_BSH = self.embed(input_ids_BS)
        q, k, v = (t.view(B, S, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x_BSH).chunk(3, -1))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles_BSD = position_ids_BS[..., None].float() * inv_freq
        cos, sin = angles_BSD.cos()[:, None], angles_BSD.sin()[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask_BSS = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
        if document_ids_BS is not None:
            mask_BSS = mask_BSS & (document_ids_BS[:, :, None] == document_ids_BS[:, None, :])
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BSS[:, None])
        x_BSH = x_BSH + self.o(attn.transpose(1, 2).reshape(B, S, -1))
        x_BSH = x_BSH + self.moe(x_BSH)
        return self.head(x_BSH)


def test_reference_model_packed_row_equals_documents_alone() -> None:
    torch.manual_seed(0)
    model = _ReferenceLM().eval()
    docs = _documents()
    packed, alone = _packed_and_alone(docs)
    with torch.no_grad():
        losses = _token_losses(model(packed["input_ids"], packed["position_ids"], packed["document_ids"]),
                               packed["labels"])  # fmt: skip
        leaky = _token_losses(model(packed["input_ids"], packed["position_ids"], None), packed["labels"])
        for seg, one in zip(_segments(packed, docs), alone):
            want = _token_losses(model(one["input_ids"], one["position_ids"], one["document_ids"]), one["labels"])
            torch.testing.assert_close(losses[seg], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(packed["labels"][0, seg], one["labels"][0])
        # Control: without document ids the later documents attend to the earlier ones.
        later = _segments(packed, docs)[1]
        assert not torch.allclose(leaky[later], losses[later], atol=1e-4)


# --- our transformer -------------------------------------------------------------------------


def _transformer_takes_documents() -> bool:
    from lightning_moe.models.transformer import MoETransformer, TransformerConfig

    params = inspect.signature(MoETransformer.forward).parameters
    fields = getattr(TransformerConfig, "__dataclass_fields__", {})
    return any(name.startswith("document_ids") for name in params) and "attention_backend" in fields


@pytest.mark.skipif(not _transformer_takes_documents(), reason="MoETransformer.forward takes no document_ids")
def test_moe_transformer_packed_row_equals_documents_alone() -> None:
    from lightning_moe.models.transformer import MoETransformer, TransformerConfig

    torch.manual_seed(0)
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2)
    cfg = TransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, moe=moe, num_dense_layers=1,
        attention_backend="sdpa",
    )  # fmt: skip
    model = MoETransformer(cfg).eval()
    docs = _documents(1)
    packed, alone = _packed_and_alone(docs)
    with torch.no_grad():
        logits = model(packed["input_ids"], packed["position_ids"], packed["document_ids"])
        losses = _token_losses(logits, packed["labels"])
        leaky = _token_losses(model(packed["input_ids"]), packed["labels"])
        for seg, one in zip(_segments(packed, docs), alone):
            out = model(one["input_ids"], one["position_ids"], one["document_ids"])
            torch.testing.assert_close(losses[seg], _token_losses(out, one["labels"]), rtol=1e-5, atol=1e-5)
        later = _segments(packed, docs)[2]
        assert not torch.allclose(leaky[later], losses[later], atol=1e-4)


# --- Hugging Face models ---------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

from lightning_moe.lit_hf import HFMoELanguageModel  # noqa: E402
from lightning_moe.models.hf import packed_attention_mask, packed_forward_kwargs  # noqa: E402

QWEN3 = {
    "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
}  # fmt: skip
QWEN2 = {
    "model_type": "qwen2_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
    "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2,
}  # fmt: skip


def _hf_module(hf_config: dict[str, Any], attn: str, swap: bool) -> HFMoELanguageModel:
    torch.manual_seed(0)
    return HFMoELanguageModel(hf_config=hf_config, attn_implementation=attn, swap=swap, fused_norms=False).eval()


def _check_hf_packed_equals_alone(module: HFMoELanguageModel, seed: int = 2) -> None:
    docs = _documents(seed)
    packed, alone = _packed_and_alone(docs)
    with torch.no_grad():
        logits = module(packed["input_ids"], position_ids=packed["position_ids"], document_ids=packed["document_ids"])
        # Position ids derived from the document ids: the mask alone must keep documents apart
        # (with restarting position ids and no mask transformers would also find the boundaries).
        derived = module(packed["input_ids"], document_ids=packed["document_ids"])
        torch.testing.assert_close(derived, logits, rtol=1e-5, atol=1e-5)
        leaky = module(packed["input_ids"])
        for seg, one in zip(_segments(packed, docs), alone):
            want = module(one["input_ids"], document_ids=one["document_ids"])  # position ids derived
            torch.testing.assert_close(logits[0, seg], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(module(one["input_ids"])[0], want[0], rtol=1e-5, atol=1e-5)
        later = _segments(packed, docs)[1]
        assert not torch.allclose(leaky[0, later], logits[0, later], atol=1e-4)


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "hf_blocks"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_qwen3_moe_packed_row_equals_documents_alone(attn: str, swap: bool) -> None:
    _check_hf_packed_equals_alone(_hf_module(QWEN3, attn, swap))


def test_hf_sliding_window_and_mixed_layer_kinds_stay_within_documents() -> None:
    qwen3_window = {**QWEN3, "use_sliding_window": True, "sliding_window": 4}  # every layer sliding
    _check_hf_packed_equals_alone(_hf_module(qwen3_window, "sdpa", swap=True), seed=3)
    mixed = _hf_module(QWEN2, "sdpa", swap=True)  # two sliding layers, one full
    assert set(mixed.model.config.layer_types) == {"sliding_attention", "full_attention"}
    _check_hf_packed_equals_alone(mixed, seed=4)


def test_packed_attention_mask_against_loops() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    for window in (None, 2):
        got = packed_attention_mask(doc, sliding_window=window)
        assert got.shape == (2, 1, 6, 6) and got.dtype == torch.bool
        for b in range(2):
            for i in range(6):
                for j in range(6):
                    want = j <= i and doc[b, i] == doc[b, j] and (window is None or i - j < window)
                    assert bool(got[b, 0, i, j]) == want
    additive = packed_attention_mask(doc, additive_dtype=torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, packed_attention_mask(doc))
    assert (additive[additive != 0] == torch.finfo(torch.bfloat16).min).all()


def test_hf_packed_input_rejects_bad_batches_and_unmasked_backends() -> None:
    module = _hf_module(QWEN3, "sdpa", swap=True)
    ids = torch.randint(1, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="document_ids decrease"):
        module(ids, document_ids=torch.tensor([[0, 0, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"position_ids\[0, 2\]=2 but that token is at 0"):
        module(ids, position_ids=torch.arange(6)[None], document_ids=torch.tensor([[0, 0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"document_ids has shape \[1, 5\]"):
        module(ids, document_ids=torch.zeros(1, 5, dtype=torch.long))

    class _Flash(nn.Module):
        config = transformers.Qwen3MoeConfig()
        config._attn_implementation = "flash_attention_2"

    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' does not take the 4-D mask"):
        packed_forward_kwargs(_Flash(), ids, torch.zeros_like(ids))


def test_hf_module_loss_on_a_packed_batch_is_the_token_mean_of_the_documents_alone() -> None:
    module = _hf_module(QWEN3, "sdpa", swap=True)
    docs = _documents(5)
    packed, alone = _packed_and_alone(docs)
    with torch.no_grad():
        loss = module._lm_loss(packed)  # no Trainer: one process, the batch's keys reach forward
        per_doc = [_token_losses(module(one["input_ids"]), one["labels"]) for one in alone]
    want = torch.cat(per_doc).mean()  # every labelled token once, each as in its document alone
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
