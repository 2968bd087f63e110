"""Pipeline stages of swapped Hugging Face MoE models: chained stages equal the whole model.

Tiny random fp32 models of Qwen3-MoE, Mixtral (also with a sliding window shorter than the
sequence, eager attention), DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid routing), OLMoE
and gpt-oss (sliding-window and full-attention layers, window shorter than the sequence) are built
here (nothing is downloaded), their MoE blocks swapped as ``HFMoELanguageModel`` does, and cut into
2 and 4 stages and two uneven splits. Running the stages one after the other gives the model's
logits and every parameter gradient bitwise, also with per-token ids passed to every stage (packed
documents: the model's packed forward; position ids restarting mid-row: the model's forward with
them); a stage's parameter names map onto the model's; a rank's stages built on ``meta`` load
their slice of the model's state dict; context parallel on a rank's stages hooks each stage (a call
without positions refused) and turns back; the families that cannot be cut are refused with the
reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf import swap_moe_blocks  # noqa: E402
from lightning_moe.models.hf_pipeline_stage import (  # noqa: E402
    HFLocalStages,
    HFTransformerStage,
    build_hf_stage,
    check_hf_pipeline_model,
    cut_hf_rank_stages,
    hf_parameter_name,
)
from lightning_moe.moe.layer import MoELayer  # noqa: E402
from lightning_moe.parallel.pipeline import split_layers  # noqa: E402

VOCAB, LAYERS = 96, 4
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, eos_token_id=1, bos_token_id=0, pad_token_id=2, tie_word_embeddings=False)  # fmt: skip
# name -> (model_type, config kwargs, attention implementation)
CONFIGS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=True), "sdpa"),
    "mixtral": ("mixtral", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2), "sdpa"),
    # a window shorter than the sequence, the mask passed to eager attention
    "mixtral_sliding_eager": ("mixtral", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                              sliding_window=8), "eager"),
    "deepseek_v3": ("deepseek_v3", dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16,
                                        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=16,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        num_key_value_heads=4), "sdpa"),
    "olmoe": ("olmoe", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), "sdpa"),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2)), None),
}  # fmt: skip
SPLITS = {
    "2": split_layers(LAYERS, 2),
    "4": split_layers(LAYERS, 4),
    "uneven": (range(0, 1), range(1, 4)),
    "uneven3": (range(0, 2), range(2, 3), range(3, 4)),
}


def _model(name: str, **changes: Any) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name, **changes), **_attention(name)).float()
    with torch.no_grad():  # a wrong bias mapping or a skipped buffer then changes the result
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "router.bias", "gate_up_proj_bias", "down_proj_bias")):
                t.normal_(0.0, 0.05)
    return swap_moe_blocks(model, experts_backend="torch").train()


def _config(name: str, **changes: Any) -> Any:
    model_type, kwargs, _ = CONFIGS[name]
    return transformers.AutoConfig.for_model(model_type, **{**_BASE, **kwargs, **changes})


def _attention(name: str) -> dict[str, str]:
    attn = CONFIGS[name][2]
    return {} if attn is None else {"attn_implementation": attn}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _loss(logits_BSV: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logits_BSV.shape, generator=torch.Generator().manual_seed(2))
    return (logits_BSV * weights).sum()


def _logits_and_grads(model: nn.Module, run: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = run(_ids())
    _loss(logits).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _chain(stages: list[HFTransformerStage]) -> Any:
    def run(ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for stage in stages:
            x = stage(x)
        return x

    return run


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chained_stages_equal_the_model_logits_and_gradients(name: str, split: str) -> None:
    model = _model(name)
    want_logits, want_grads = _logits_and_grads(model, lambda ids: model(input_ids=ids, use_cache=False).logits)
    stages = [build_hf_stage(model, r, LAYERS) for r in SPLITS[split]]
    assert [s.is_first for s in stages] == [True] + [False] * (len(stages) - 1)
    assert [s.is_last for s in stages] == [False] * (len(stages) - 1) + [True]
    got_logits, got_grads = _logits_and_grads(model, _chain(stages))
    torch.testing.assert_close(got_logits, want_logits, atol=0, rtol=0)
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=0, rtol=0, msg=name)


def _packed_ids(ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids starting a document at random tokens, and the positions restarting with each."""
    from lightning_moe.data.packing import position_ids_from_document_ids

    starts = torch.rand(ids_BS.shape, generator=torch.Generator().manual_seed(5)) < 0.2
    starts[:, 0] = False
    documents_BS = starts.long().cumsum(1)
    return documents_BS, position_ids_from_document_ids(documents_BS)


@pytest.mark.parametrize("ids", ["documents", "positions"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_sliding_eager", "gpt_oss", "deepseek_v3"])
def test_chained_stages_given_per_token_ids_equal_the_model_given_them(name: str, ids: str) -> None:
    from lightning_moe.models.hf_packed import packed_forward_kwargs

    model = _model(name)
    documents_BS, positions_BS = _packed_ids(_ids())
    if ids == "documents":  # what HFMoELanguageModel.forward gives the model for packed rows
        stage_kw: dict[str, torch.Tensor] = {"document_ids": documents_BS}
        model_kw = lambda ids_BS: packed_forward_kwargs(model, ids_BS, documents_BS)  # noqa: E731
    else:
        stage_kw = {"position_ids": positions_BS}
        model_kw = lambda ids_BS: {"position_ids": positions_BS}  # noqa: E731
    want_logits, want_grads = _logits_and_grads(model, lambda i: model(input_ids=i, use_cache=False, **model_kw(i)).logits)
    plain, _ = _logits_and_grads(model, lambda i: model(input_ids=i, use_cache=False).logits)
    assert (plain - want_logits).abs().max() > 1e-5, "the ids do not change the logits: a weak test"
    stages = [build_hf_stage(model, r, LAYERS) for r in SPLITS["uneven"]]

    def run(ids_BS: torch.Tensor) -> torch.Tensor:
        x = ids_BS
        for stage in stages:
            x = stage(x, **stage_kw)
        return x

    got_logits, got_grads = _logits_and_grads(model, run)
    torch.testing.assert_close(got_logits, want_logits, atol=0, rtol=0)
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=0, rtol=0, msg=key)


def test_context_parallel_on_a_ranks_stages_hooks_each_stage_and_turns_back(fake_world: Any) -> None:
    import torch.distributed as dist

    from lightning_moe.models.context_parallel import enable_context_parallel
    from lightning_moe.models.hf_context_parallel import CP_ATTENTION, uses_hf_context_parallel

    fake_world(0, 1)
    model = _model("qwen3_moe")
    holder = nn.Module()
    holder.model = cut_hf_rank_stages(model, SPLITS["4"], (1, 3))
    enable_context_parallel(holder, dist.group.WORLD)
    assert uses_hf_context_parallel(holder) and model.config._attn_implementation == CP_ATTENTION
    views = [view for _, view in holder.model.stages]
    assert all(len(view._forward_pre_hooks) == 1 for view in views)
    for view in views:
        with pytest.raises(ValueError, match="under context parallelism pass position_ids"):
            view(torch.zeros(2, 8, 32), document_ids=torch.zeros(2, 8, dtype=torch.long))
    enable_context_parallel(holder, None)
    assert not uses_hf_context_parallel(holder) and model.config._attn_implementation == "sdpa"
    assert all(not view._forward_pre_hooks for view in views)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_stage_names_are_the_model_names_and_cover_it_once(family: str) -> None:
    model = _model(family)
    params = dict(model.named_parameters())
    ranges = SPLITS["4"]
    seen: list[str] = []
    for r in ranges:
        stage = build_hf_stage(model, r, LAYERS)
        assert sorted(stage.layers) == sorted(str(i) for i in r)
        for name, p in stage.named_parameters():
            assert params[hf_parameter_name(name)] is p, name
            seen.append(hf_parameter_name(name))
    assert sorted(seen) == sorted(params)
    sliced = {hf_parameter_name(k): v for k, v in build_hf_stage(model, ranges[-1], LAYERS).state_dict().items()}
    full = model.state_dict()
    assert all(full[k] is v or torch.equal(full[k], v) for k, v in sliced.items())
    with pytest.raises(ValueError, match="not a stage name"):
        hf_parameter_name("rotary_emb.inv_freq")


def test_rank_stages_hold_their_layers_under_model_names_and_count_moe_layers_globally() -> None:
    model = _model("deepseek_v3")  # layer 0 dense, layers 1..3 MoE
    local = cut_hf_rank_stages(model, SPLITS["4"], (0, 2))
    assert isinstance(local, HFLocalStages) and [s for s, _ in local.stages] == [0, 2]
    assert local.embed is model.model.embed_tokens and local.lm_head is None and local.norm is None
    assert local.rotary_emb is model.model.rotary_emb
    assert sorted(local.layers) == ["0", "2"]
    params = dict(model.named_parameters())
    assert all(params[hf_parameter_name(n)] is p for n, p in local.named_parameters())
    moe = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, MoELayer)]
    assert [m.global_moe_index for m in moe] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="pipeline schedule"):
        local(_ids())


def test_stages_of_a_meta_model_load_a_slice_of_the_state_dict() -> None:
    from lightning_moe.checkpoint.hf_sharded import reset_nonpersistent_buffers

    model = _model("qwen3_moe")
    want_logits, _ = _logits_and_grads(model, lambda ids: model(input_ids=ids, use_cache=False).logits)
    with torch.device("meta"):
        meta = _model_on_meta("qwen3_moe")
    local = cut_hf_rank_stages(meta, SPLITS["2"], (0, 1))
    local.to_empty(device="cpu")
    reset_nonpersistent_buffers(local)
    full = model.state_dict()
    local.load_state_dict({n: full[hf_parameter_name(n)] for n in local.state_dict()})
    local.train()
    got = _chain([view for _, view in local.stages])(_ids())  # type: ignore[misc]
    torch.testing.assert_close(got.detach(), want_logits, atol=0, rtol=0)


def _model_on_meta(name: str) -> nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(_config(name), **_attention(name))
    return swap_moe_blocks(model, experts_backend="torch")


class _Holder(nn.Module):
    """A module with only an HF config (families too costly to build for a refusal)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config


@pytest.mark.parametrize(
    ("model_type", "match"),
    [
        ("qwen3_next", "qwen3_next model .* linear-attention or state-space layers"),
        ("minimax", "minimax model .* linear-attention"),
        ("jamba", "jamba model .* state-space"),
        ("qwen3_vl_moe", "qwen3_vl_moe model .* vision-language wrapper"),
        ("granitemoe", r"granitemoe model .*\(embedding_multiplier\)"),
        ("cohere2_moe", "cohere2_moe model .* logit_scale"),
        ("phimoe", "phimoe model .* has not been checked"),
        ("llama4_text", "llama4_text model .* has not been checked"),
    ],
)
def test_families_that_cannot_be_cut_are_refused_with_the_reason(model_type: str, match: str) -> None:
    holder = _Holder(transformers.AutoConfig.for_model(model_type))
    with pytest.raises(ValueError, match=match):
        build_hf_stage(holder, range(0, 1), 2)


def test_tied_embeddings_and_bad_shapes_are_refused() -> None:
    tied = _model("qwen3_moe", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="qwen3_moe model .* tie_word_embeddings=True"):
        build_hf_stage(tied, range(0, 2), LAYERS)
    model = _model("olmoe")
    assert check_hf_pipeline_model(model) == "causal"
    with pytest.raises(ValueError, match="num_layers=3 but the model has 4"):
        build_hf_stage(model, range(0, 2), 3)
    for bad in (range(2, 2), range(0, 5), range(0, 4, 2), (0, 2)):
        with pytest.raises(ValueError, match="must be a non-empty range"):
            build_hf_stage(model, bad, LAYERS)  # type: ignore[arg-type]
    odd = _model("gpt_oss")
    odd.config.layer_types = ["chunked_attention"] * LAYERS
    with pytest.raises(ValueError, match="gpt_oss model .* layer_types"):
        build_hf_stage(odd, range(0, 2), LAYERS)
    with pytest.raises(ValueError, match="not a decoder-only causal LM"):
        build_hf_stage(_Holder(model.config), range(0, 2), LAYERS)
