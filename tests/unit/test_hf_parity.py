"""Parity with Hugging Face transformers' sparse MoE blocks (Qwen3-MoE, Mixtral).

Tiny random configs built here (no hub access); the HF weights are copied into a MoELayer:

* router: ``gate.weight [E, H]`` -> ``router.weight [E, H]``;
* experts: ``experts.gate_up_proj [E, 2F, H]`` (gate rows first, split by ``chunk(2)``) ->
  ``w13 = gate_up_proj^T [E, H, 2F]``; ``experts.down_proj [E, H, F]`` -> ``w2 = down_proj^T [E, F, H]``.

H != 2F so a wrong transpose cannot pass by shape.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="HF parity needs transformers (pip install 'lightning-moe[test]')")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
from transformers import MixtralConfig, Qwen3MoeConfig  # noqa: E402

from lightning_moe.config import MoEConfig  # noqa: E402
from lightning_moe.moe.layer import MoELayer  # noqa: E402

H, FF, E, K = 16, 12, 8, 2
ATOL, RTOL = 1e-5, 1e-5  # fp32


def _randomise(block: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)


def _layer_from_hf(block: torch.nn.Module, cfg: MoEConfig) -> MoELayer:
    layer = MoELayer(cfg)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    assert gate_up.shape == (E, 2 * FF, H) and down.shape == (E, H, FF)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w13.copy_(gate_up.transpose(1, 2))
        layer.experts.w2.copy_(down.transpose(1, 2))
    return layer


def _compare(block: torch.nn.Module, layer: MoELayer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, H, generator=g)
    grad = torch.randn(2, 7, H, generator=g)

    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf, y_ours = block(x_hf), layer(x_ours)
    assert y_ours.shape == y_hf.shape
    torch.testing.assert_close(y_ours, y_hf, atol=ATOL, rtol=RTOL)

    (y_hf * grad).sum().backward()
    (y_ours * grad).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(
        layer.experts.w13.grad, block.experts.gate_up_proj.grad.transpose(1, 2), atol=ATOL, rtol=RTOL
    )
    torch.testing.assert_close(
        layer.experts.w2.grad, block.experts.down_proj.grad.transpose(1, 2), atol=ATOL, rtol=RTOL
    )


_TOP1_NORM = pytest.mark.xfail(
    strict=True,
    reason="known divergence: HF renormalises a single expert's weight to exactly 1 (the router gets no "
    "gradient from the main loss); MoELayer keeps the softmax probability when top_k=1 (Switch/Megatron), "
    "so no MoEConfig reproduces Qwen3 top_k=1 with norm_topk_prob=True",
)


@pytest.mark.parametrize(
    ("top_k", "norm_topk_prob"),
    [(2, True), (2, False), (3, True), (3, False), (1, False), pytest.param(1, True, marks=_TOP1_NORM)],
    ids=["k2-norm", "k2-no_norm", "k3-norm", "k3-no_norm", "k1-no_norm", "k1-norm"],
)
def test_qwen3_moe_sparse_block_parity(top_k: int, norm_topk_prob: bool) -> None:
    hf_cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FF,
        num_experts=E,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
        experts_implementation="eager",
    )
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    _randomise(block, seed=top_k)
    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=FF,
        num_experts=E,
        top_k=top_k,
        score_func="softmax",
        pre_softmax=True,
        norm_topk_prob=norm_topk_prob,
        aux_loss="none",
    )
    _compare(block, _layer_from_hf(block, cfg).eval(), seed=10 + top_k)


@pytest.mark.parametrize(
    "routing",
    [dict(pre_softmax=False), dict(pre_softmax=True, norm_topk_prob=True)],
    ids=["softmax_over_topk_logits", "pre_softmax_renormalised"],
)
def test_mixtral_sparse_block_parity(routing: dict) -> None:
    hf_cfg = MixtralConfig(
        hidden_size=H,
        intermediate_size=FF,
        num_local_experts=E,
        num_experts_per_tok=K,
        router_jitter_noise=0.0,
        hidden_act="silu",
        experts_implementation="eager",
    )
    block = mixtral.MixtralSparseMoeBlock(hf_cfg).eval()
    _randomise(block, seed=5)
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, aux_loss="none", **routing)
    _compare(block, _layer_from_hf(block, cfg).eval(), seed=6)


def test_parity_holds_in_training_mode_without_aux_loss() -> None:
    # Training mode exercises the same path plus the aux-loss hook; with aux_loss='none' and no
    # z-loss the output must still equal HF's.
    hf_cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FF,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        experts_implementation="eager",
    )
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg).train()
    _randomise(block, seed=8)
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, pre_softmax=True, aux_loss="none")
    _compare(block, _layer_from_hf(block, cfg).train(), seed=9)
