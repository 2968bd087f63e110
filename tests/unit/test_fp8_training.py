"""FP8 training of the tiny model on CPU (emulated FP8 GEMMs) lowers the loss as bf16 training does.

Both arms start from the same weights and see the same batches of the embedded corpus under bf16
autocast; the FP8 arm runs the experts and the dense layers in the blockwise recipe (the GEMM math
of the GPU kernels, emulated). Stated tolerance: over the last 5 of 40 AdamW steps the FP8 mean loss
is within 2 % of bf16's, and both are at least 25 % below the first step's loss.
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.config import Fp8Config, MoEConfig
from lightning_moe.data.corpus import load_tokens
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.ops.fp8.linear import Fp8Linear

STEPS, B, S = 40, 8, 32
TOLERANCE = 0.02


def _model(fp8: bool) -> MoETransformer:
    moe = MoEConfig(hidden_size=64, ffn_hidden_size=64, num_experts=4, top_k=2, pre_softmax=True,
                    shared_expert_ffn_size=64, fp8=Fp8Config(recipe="blockwise", backend="emulate") if fp8 else None)  # fmt: skip
    cfg = TransformerConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_dense_layers=1,
                            dense_ffn_hidden_size=128, max_seq_len=64, moe=moe, fp8_dense="on" if fp8 else "off")  # fmt: skip
    torch.manual_seed(0)
    return MoETransformer(cfg)


def _train(fp8: bool, tokens: torch.Tensor) -> list[float]:
    model = _model(fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, tokens.numel() - S - 1, (B,), generator=g)
        rows = torch.stack([tokens[s : s + S + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.slow
def test_fp8_emulated_training_follows_bf16() -> None:
    tokens = load_tokens(None, max_bytes=200_000).long()
    assert any(isinstance(m, Fp8Linear) for m in _model(True).modules())  # the FP8 arm is really FP8
    bf16, fp8 = _train(False, tokens), _train(True, tokens)
    assert bf16 != fp8  # quantization changes the numbers (the arms are not secretly the same)
    tail_bf16, tail_fp8 = sum(bf16[-5:]) / 5, sum(fp8[-5:]) / 5
    assert tail_bf16 < 0.75 * bf16[0] and tail_fp8 < 0.75 * fp8[0], (bf16, fp8)
    assert abs(tail_fp8 - tail_bf16) / tail_bf16 < TOLERANCE, (tail_bf16, tail_fp8)
