"""Pipeline parallel of a swapped Hugging Face MoE model in the folded strategies, in one process.

A tiny random Qwen3-MoE ``HFMoELanguageModel`` (4 decoder layers, untied embeddings): the strategy's
model check accepts it at pp=2 (also under cp=2 and sequence parallel, which its stages carry) and
refuses an uneven split, tied embeddings and a module holding no model, each with the strategy's
name; the cut puts this rank's ``HFLocalStages`` where the HF model was (its ``model`` attribute, or
the stages themselves for Fabric); stages materialised from ``meta`` get the rotary frequencies a
fresh model computes; ``num_active_params`` counts a rank's stages; checkpoint names of the stages
map to the whole model's (model and optimizer entries), and the export maps stage names back too
(the exported model equals the one exported uncut).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.lit_hf import HFMoELanguageModel  # noqa: E402
from lightning_moe.models.hf_pipeline_stage import HFLocalStages  # noqa: E402
from lightning_moe.parallel.pipeline import split_layers  # noqa: E402
from lightning_moe.strategies import FoldedMoEStrategy  # noqa: E402
from lightning_moe.checkpoint.stage_names import hf_stage_renamer, renamed_optimizer_state  # noqa: E402
from lightning_moe.strategies.pipeline_hf import restore_hf_buffers  # noqa: E402
from lightning_moe.strategies.pipeline_setup import cut_for_pipeline  # noqa: E402

HF_CONFIG: dict[str, Any] = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)  # fmt: skip


def _lm(**changes: Any) -> HFMoELanguageModel:
    torch.manual_seed(0)
    return HFMoELanguageModel(hf_config={**HF_CONFIG, **changes}, moe={"experts_backend": "torch"})


def test_model_check_accepts_a_cuttable_hf_model_and_refuses_the_rest() -> None:
    strategy = FoldedMoEStrategy(pp=2)
    strategy.check_pipeline_model(_lm())
    FoldedMoEStrategy(pp=2, cp=2).check_pipeline_model(_lm())
    FoldedMoEStrategy(pp=2, tp=2, sequence_parallel=True).check_pipeline_model(_lm())
    with pytest.raises(ValueError, match="FoldedMoEStrategy: num_layers=3 does not split evenly into 2 stages"):
        strategy.check_pipeline_model(_lm(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"FoldedMoEStrategy: cannot cut a qwen3_moe model .*tie_word_embeddings=True"):
        strategy.check_pipeline_model(_lm(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="use MoELanguageModel or HFMoELanguageModel"):
        strategy.check_pipeline_model(nn.Linear(2, 2))


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_cut_places_this_ranks_stages_where_the_model_was(pp_rank: int) -> None:
    strategy = FoldedMoEStrategy(pp=2)
    lm = _lm()
    holder, stages = cut_for_pipeline("FoldedMoEStrategy", strategy.pipeline_options, lm, pp_rank)
    assert holder is lm and lm.model is stages and isinstance(stages, HFLocalStages)
    assert list(stages.layers) == [str(i) for i in split_layers(4, 2)[pp_rank]]
    assert (stages.embed is not None) == (pp_rank == 0) and (stages.lm_head is not None) == (pp_rank == 1)
    assert lm.num_active_params() > 0  # this rank's stages
    fabric_model = _lm().model
    alone, same = cut_for_pipeline("FoldedMoEStrategy", strategy.pipeline_options, fabric_model, pp_rank)
    assert alone is same and isinstance(alone, HFLocalStages)


def test_stages_built_on_meta_get_the_rotary_frequencies_back() -> None:
    fresh = _lm().model.model.rotary_emb.inv_freq.clone()
    with torch.device("meta"):
        lm = _lm()
    _, stages = cut_for_pipeline("FoldedMoEStrategy", FoldedMoEStrategy(pp=2).pipeline_options, lm, 1)
    stages.to_empty(device="cpu")
    stages.rotary_emb.inv_freq.fill_(float("nan"))  # what an empty materialisation may leave
    restore_hf_buffers(stages)
    torch.testing.assert_close(stages.rotary_emb.inv_freq, fresh, rtol=0, atol=0)
    view = stages.stages[0][1]
    assert view.rotary_emb.inv_freq is stages.rotary_emb.inv_freq  # the stage views run the restored module


def test_checkpoint_names_of_hf_stages_are_the_whole_models() -> None:
    whole, cut = _lm(), _lm()
    assert hf_stage_renamer(whole) is None
    cut_for_pipeline("FoldedMoEStrategy", FoldedMoEStrategy(pp=2).pipeline_options, cut, 1)
    rename = hf_stage_renamer(cut)
    names = {rename(k) for k in cut.state_dict()}
    assert names <= set(whole.state_dict()) and "model.lm_head.weight" in names
    assert rename("model.layers.3.mlp.experts.w13.gate") == "model.model.layers.3.mlp.experts.w13.gate"
    optim = {"state": {"model.norm.weight": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["model.norm.weight"]}]}
    renamed = renamed_optimizer_state(optim, rename)
    assert renamed["state"] == {"model.model.norm.weight": {"step": 1}}
    assert renamed["param_groups"] == [{"lr": 0.1, "params": ["model.model.norm.weight"]}]
    assert renamed["state"]["model.model.norm.weight"] is optim["state"]["model.norm.weight"]  # a load fills both


def test_export_maps_stage_names_to_the_hf_models(tmp_path) -> None:
    from safetensors.torch import load_file

    from lightning_moe.export import export_state_dict

    lm = _lm()
    whole = {k: v.clone() for k, v in lm.model.state_dict().items()}
    options = FoldedMoEStrategy(pp=2, pp_microbatches=2).pipeline_options
    stage_state: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        _, stages = cut_for_pipeline("FoldedMoEStrategy", options, _lm(), rank)
        stage_state.update(stages.state_dict())
    assert "embed.weight" in stage_state and "model.embed_tokens.weight" not in stage_state
    moe = {"experts_backend": "torch"}
    export_state_dict(whole, tmp_path / "whole", hf_config=dict(HF_CONFIG), moe=moe)
    export_state_dict(stage_state, tmp_path / "cut", hf_config=dict(HF_CONFIG), moe=moe)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
