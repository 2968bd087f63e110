"""Pipeline plan and stage modules in one process: layer splits, stage placement, schedules by name,
and stages cut from an MoETransformer that chain to the whole model's forward and backward."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import MoETransformer, TransformerConfig, rope_tables
from lightning_moe.parallel.pipeline import (
    SCHEDULES, check_batch_split, check_microbatches, check_schedule, split_layers, stage_indices,
)  # fmt: skip
from lightning_moe.parallel.pipeline_stage import build_transformer_stage, cut_rank_stages, materialize_stage

# ---- split_layers ----------------------------------------------------------------------------------


def test_even_split_gives_equal_contiguous_ranges() -> None:
    assert split_layers(8, 2) == (range(0, 4), range(4, 8))
    assert split_layers(8, 2, 2) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))


def test_weighted_split_counts_the_embedding_and_the_head_as_a_layer_each() -> None:
    # 6 blocks + embedding + head = 8 layers' worth over 4 stages: 2 each
    assert split_layers(6, 4, weights=[1.0] * 6) == (range(0, 1), range(1, 3), range(3, 5), range(5, 6))
    # 4 blocks + 2 over 2 stages: 3 each
    assert split_layers(4, 2, weights=[1.0] * 4) == (range(0, 2), range(2, 4))
    # the head free: 5 blocks + embedding over 2 stages
    assert split_layers(5, 2, weights=[1.0] * 5, head_cost=0.0) == (range(0, 2), range(2, 5))
    # a heavy block gets a stage of its own
    assert split_layers(4, 3, weights=[1.0, 9.0, 1.0, 1.0], embedding_cost=0.0, head_cost=0.0) == (
        range(0, 1), range(1, 2), range(2, 4),
    )  # fmt: skip


def _stage_cost(ranges: tuple[range, ...], weights: list[float], emb: float, head: float) -> float:
    costs = [sum(weights[i] for i in r) for r in ranges]
    costs[0] += emb
    costs[-1] += head
    return max(costs)


@pytest.mark.parametrize("seed", range(20))
def test_weighted_split_is_the_cheapest_contiguous_split(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 9, (), generator=g))
    stages = int(torch.randint(1, n + 1, (), generator=g))
    weights = (torch.rand(n, generator=g) * 4).tolist()
    emb, head = (torch.rand(2, generator=g) * 2).tolist()
    got = split_layers(n, stages, weights=weights, embedding_cost=emb, head_cost=head)
    assert [i for r in got for i in r] == list(range(n)) and all(len(r) > 0 for r in got)
    brute = min(
        _stage_cost(tuple(range(a, b) for a, b in zip((0, *cuts), (*cuts, n))), weights, emb, head)
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    assert _stage_cost(got, weights, emb, head) == pytest.approx(brute)


# ---- stage placement and schedules -----------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "v", "style"), [("interleaved_1f1b", 2, "loop"), ("interleaved_1f1b", 3, "loop"),
                                                     ("zbv", 2, "v"), ("dualpipev", 2, "v")])  # fmt: skip
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_placement_matches_torch_schedules(schedule: str, v: int, style: str, pp: int) -> None:
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    for rank in range(pp):
        assert stage_indices(rank, pp, schedule, v) == tuple(s for s, r in sorted(mapping.items()) if r == rank)


def test_single_stage_schedules_put_stage_r_on_rank_r() -> None:
    assert [stage_indices(r, 4, "1f1b") for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert stage_indices(1, 2, "zbv", 2) == (1, 2)


def test_every_named_schedule_exists_in_this_torch() -> None:
    import torch.distributed.pipelining as pipelining

    for name, spec in SCHEDULES.items():
        check_schedule(name, spec.virtual_stages or 2)
        assert hasattr(pipelining, spec.torch_class), name


def test_microbatch_rules_accept_what_the_schedules_run() -> None:
    check_microbatches("gpipe", 1, 4)
    check_microbatches("1f1b", 4, 4)
    check_microbatches("interleaved_1f1b", 3, 4, 2)  # one round of 3
    check_microbatches("interleaved_1f1b", 8, 4, 2)
    check_microbatches("zbv", 4, 2, 2)
    assert check_batch_split(8, 4) == 2


# ---- stage modules ---------------------------------------------------------------------------------


def _config(tie: bool = False) -> TransformerConfig:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss="switch",
                    aux_loss_coeff=0.1, z_loss_coeff=1e-2)  # fmt: skip
    return TransformerConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, moe=moe,
                             num_dense_layers=1, max_seq_len=16, tie_embeddings=tie)  # fmt: skip


def _tables(cfg: TransformerConfig):  # noqa: ANN202
    return lambda S, device: rope_tables(S, cfg.head_dim, cfg.rope_theta, device)


@pytest.mark.parametrize(("pp", "v"), [(2, 1), (2, 2), (4, 1), (1, 1)])
def test_chained_stages_equal_the_whole_model_forward_and_backward(pp: int, v: int) -> None:
    cfg = _config()
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    whole = copy.deepcopy(model)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    F.cross_entropy(whole(ids).flatten(0, 1), labels.flatten()).backward()
    stages = [build_transformer_stage(model, r, 4, _tables(cfg)) for r in split_layers(4, pp, v)]
    x = ids
    for stage in stages:
        x = stage(x)
    F.cross_entropy(x.flatten(0, 1), labels.flatten()).backward()
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())  # the model's own names
    want = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-6, atol=1e-8, msg=name)
    assert stages[0].is_first and stages[-1].is_last and (len(stages) == 1 or not stages[0].is_last)


def test_stage_built_on_meta_allocates_only_its_slice() -> None:
    cfg = _config()
    with torch.device("meta"):
        model = MoETransformer(cfg)
    stage = materialize_stage(build_transformer_stage(model, range(2, 4), 4, _tables(cfg)), "cpu", cfg.init_std)
    params = dict(stage.named_parameters())
    assert all(p.device.type == "cpu" for p in params.values())
    assert {n.split(".")[0] for n in params} == {"layers", "norm", "lm_head"}
    assert {n.split(".")[1] for n in params if n.startswith("layers.")} == {"2", "3"}
    assert torch.equal(params["norm.weight"], torch.ones(32))
    assert 0.015 < float(params["lm_head.weight"].detach().std()) < 0.025
    assert stage(torch.randn(2, 8, 32)).shape == (2, 8, 64)


def test_stage_refuses_tied_embeddings_split_over_stages_and_bad_ranges() -> None:
    tied = MoETransformer(_config(tie=True))
    with pytest.raises(ValueError, match="tie_embeddings=True shares the embedding with the head"):
        build_transformer_stage(tied, range(0, 2), 4, _tables(tied.config))
    build_transformer_stage(tied, range(0, 4), 4, _tables(tied.config))  # one stage holds both: fine
    with pytest.raises(ValueError, match=r"layers=range\(2, 6\) must be a non-empty range"):
        build_transformer_stage(tied, range(2, 6), 4, _tables(tied.config))
    with pytest.raises(ValueError, match="num_layers=3 but the model has 4 blocks"):
        build_transformer_stage(tied, range(0, 2), 3, _tables(tied.config))
    with pytest.raises(ValueError, match="has no attribute 'embed'"):
        build_transformer_stage(torch.nn.Linear(2, 2), range(0, 1), 1, _tables(tied.config))


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_rank_stages_hold_the_model_names_once_and_cover_the_model(schedule: str, v: int) -> None:
    """Every pipeline rank's ``LocalStages`` owns its stages' modules under the model's names; the
    ranks together hold each parameter once; its stage views share those modules."""
    cfg = _config()
    model = MoETransformer(cfg)
    ranges = split_layers(4, 2, v)
    held = []
    for rank in range(2):
        local = cut_rank_stages(model, ranges, stage_indices(rank, 2, schedule, v), _tables(cfg))
        names = [n for n, _ in local.named_parameters()]
        assert len(names) == len(set(names))
        held += names
        shared = {id(p) for _, view in local.stages for p in view.parameters()}
        assert shared == {id(p) for p in local.parameters()}
        assert local.embed is (model.embed if any(view.is_first for _, view in local.stages) else None)
        with pytest.raises(RuntimeError, match="run through the pipeline schedule"):
            local(torch.zeros(1, 4, dtype=torch.long))
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())
    moe_layers = [b.ffn for b in model.layers if hasattr(b.ffn, "experts")]
    assert [m.global_moe_index for m in moe_layers] == list(range(len(moe_layers)))


@pytest.mark.parametrize("cp", [1, 2])
def test_hf_gradient_checkpointing_under_cp_is_refused_before_the_schedule(cp: int) -> None:
    """Under CP an HF model's attention reads the last forward's ids, which a recomputed forward in a
    pipeline schedule's backward would not see: refused at cp > 1, allowed at cp = 1."""
    from lightning_moe.parallel.fold_batch import ContextParallel
    from lightning_moe.strategies.pipeline_setup import PipelineOptions
    from lightning_moe.strategies.pipeline_step import PipelineRunner

    runner = PipelineRunner.__new__(PipelineRunner)  # the check reads owner, options, stages, context only
    runner.owner, runner.options = "FoldedMoEStrategy", PipelineOptions(2, "1f1b", 4, 1)
    runner.context = ContextParallel(None, cp, 0)
    runner.stages = torch.nn.Sequential(torch.nn.Linear(2, 2))
    runner._check_no_hf_checkpointing_under_cp()  # no checkpointing: nothing to refuse
    runner.stages[0].gradient_checkpointing = True
    if cp == 1:
        runner._check_no_hf_checkpointing_under_cp()
        return
    with pytest.raises(ValueError, match="gradient checkpointing is on .* cp=2 and pp=2.*gradient_checkpointing_disable"):
        runner._check_no_hf_checkpointing_under_cp()
