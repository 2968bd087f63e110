"""The expert-math options of MoEConfig (``router_bias``, ``expert_mlp_bias``, ``swiglu_alpha``,
``swiglu_limit``, ``swiglu_up_offset``) against plain per-expert autograd written here.

Legend: T tokens, R rows grouped by expert, H hidden, F expert FFN width, E experts, K top-k.

Covered: the SwiGLU variant alone (values at and beyond the clamp), the grouped expert MLP
(``torch`` and ``loop`` GEMM backends, with and without row weights, empty experts, one busy
expert), and whole layers on the fused local path and on the separate dispatch → experts →
combine path, with degenerate routing (an expert no token picks, every token on one expert).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lightning_moe.config import Fp8Config, MoEConfig
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.layer import MoELayer
from lightning_moe.ops.expert_mlp import expert_swiglu_mlp
from lightning_moe.ops.grouped_gemm import offsets_from_counts
from lightning_moe.ops.swiglu import SwiGLUOptions, weighted_swiglu

ATOL = RTOL = 1e-5
H, FF = 8, 12
GPT_OSS = SwiGLUOptions(alpha=1.702, limit=0.6, up_offset=1.0)  # a low limit: the clamp is active here
OPTIONS = {"gpt_oss_like": GPT_OSS, "alpha_only": SwiGLUOptions(alpha=0.7), "plain": SwiGLUOptions()}


def act_spec(h_R2F: torch.Tensor, opts: SwiGLUOptions) -> torch.Tensor:
    """``g * sigmoid(alpha * g) * (u + offset)``, g and u clamped, written as gpt-oss writes it."""
    gate, up = h_R2F[..., :FF], h_R2F[..., FF:]
    if opts.limit is not None:
        gate = gate.clamp(min=None, max=opts.limit)
        up = up.clamp(min=-opts.limit, max=opts.limit)
    return gate * torch.sigmoid(gate * opts.alpha) * (up + opts.up_offset)


def experts_spec(x_RH, w13, w2, b13, b2, counts, w_R, opts):  # noqa: ANN001, ANN201
    """Per expert on its own rows: ``w * (act(x @ w13 + b13) @ w2 + b2)``."""
    out, start = [], 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        h = x_RH[rows] @ w13[e] + (0 if b13 is None else b13[e])
        y = act_spec(h, opts) @ w2[e] + (0 if b2 is None else b2[e])
        out.append(y if w_R is None else y * w_R[rows, None])
        start += count
    return torch.cat(out)


def _leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ---- the activation ---------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [True, False], ids=["row_weights", "no_row_weights"])
@pytest.mark.parametrize("opts_name", sorted(OPTIONS))
def test_swiglu_variant_and_its_gradients_match_autograd(opts_name: str, weighted: bool) -> None:
    opts = OPTIONS[opts_name]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 2 * FF, generator=g)
    if opts.limit is not None:  # values exactly at the clamp bounds: autograd's clamp passes their gradient
        h[0, :FF] = opts.limit
        h[1, FF:] = -opts.limit
        h[2, FF:] = opts.limit
    w = torch.rand(40, generator=g) + 0.1 if weighted else None
    grad = torch.randn(40, FF, generator=g)
    ha, wa = _leaves(h, w)
    weighted_swiglu(ha, wa, opts).backward(grad)
    hr, wr = _leaves(h, w)
    ref = act_spec(hr, opts) * (1 if wr is None else wr[:, None])
    ref.backward(grad)
    _close(weighted_swiglu(h, w, opts), ref, "a")
    _close(ha.grad, hr.grad, "grad h")
    if weighted:
        _close(wa.grad, wr.grad, "grad w")
    if opts.limit is not None:  # the clamp did something on these inputs
        assert bool((h[:, :FF] > opts.limit).any()) and bool((h[:, FF:].abs() > opts.limit).any())


# ---- the grouped expert MLP -------------------------------------------------------------------

COUNTS = {"empty_middle": [3, 0, 5, 0, 2], "one_busy_expert": [0, 0, 9, 0], "empty_ends": [0, 4, 1, 6, 0]}


def _expert_inputs(counts: list[int], seed: int, weighted: bool):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    x = torch.randn(R, H, generator=g)
    w13 = torch.randn(E, H, 2 * FF, generator=g) * 0.4
    w2 = torch.randn(E, FF, H, generator=g) * 0.4
    b13 = torch.randn(E, 2 * FF, generator=g) * 0.5
    b2 = torch.randn(E, H, generator=g) * 0.5
    w_R = torch.rand(R, generator=g) + 0.1 if weighted else None
    return x, w13, w2, b13, b2, w_R, torch.randn(R, H, generator=g)


@pytest.mark.parametrize("weighted", [True, False], ids=["row_weights", "no_row_weights"])
@pytest.mark.parametrize("counts_name", sorted(COUNTS))
@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_expert_mlp_with_biases_and_clamped_swiglu_matches_spec(backend: str, counts_name: str, weighted: bool) -> None:
    counts = COUNTS[counts_name]
    x, w13, w2, b13, b2, w_R, grad_y = _expert_inputs(counts, len(counts_name), weighted)
    offs = offsets_from_counts(torch.tensor(counts))
    ours = _leaves(x, w13, w2, b13, b2, w_R)
    y = expert_swiglu_mlp(*ours[:3], offs, ours[5], backend, b13=ours[3], b2=ours[4], opts=GPT_OSS)
    y.backward(grad_y)
    ref = _leaves(x, w13, w2, b13, b2, w_R)
    y_ref = experts_spec(*ref[:5], counts, ref[5], GPT_OSS)
    y_ref.backward(grad_y)
    _close(y, y_ref, "y")
    for name, a, r in zip(("x", "w13", "w2", "b13", "b2", "w_R"), ours, ref):
        if a is not None:
            _close(a.grad, r.grad, f"grad {name}")
    for e, count in enumerate(counts):  # an expert with no rows: exact zero gradients
        if count == 0:
            assert not ours[3].grad[e].any() and not ours[4].grad[e].any()


def test_expert_mlp_rows_past_the_last_group_get_no_bias() -> None:
    counts = COUNTS["empty_middle"]
    x, w13, w2, b13, b2, w_R, _ = _expert_inputs(counts, 3, weighted=True)
    pad = torch.zeros(3, H)
    offs = offsets_from_counts(torch.tensor(counts))
    y = expert_swiglu_mlp(torch.cat([x, pad]), w13, w2, offs, torch.cat([w_R, torch.ones(3)]), "loop",
                          b13=b13, b2=b2, opts=GPT_OSS)  # fmt: skip
    _close(y[: sum(counts)], experts_spec(x, w13, w2, b13, b2, counts, w_R, GPT_OSS), "routed rows")
    assert not y[sum(counts) :].any()


# ---- whole layers -----------------------------------------------------------------------------


def _config(**changes: object) -> MoEConfig:
    base = dict(hidden_size=H, ffn_hidden_size=FF, num_experts=6, top_k=2, router_bias=True, expert_mlp_bias=True,
                swiglu_alpha=GPT_OSS.alpha, swiglu_limit=GPT_OSS.limit, swiglu_up_offset=GPT_OSS.up_offset,
                aux_loss="none", experts_backend="torch")  # fmt: skip
    return MoEConfig(**{**base, **changes})  # type: ignore[arg-type]


def _random_layer(cfg: MoEConfig, router_bias: torch.Tensor | None = None) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
        if router_bias is not None:
            layer.router.bias.copy_(router_bias)
    return layer


def layer_spec(layer: MoELayer, x_TH: torch.Tensor) -> torch.Tensor:
    """Plain loops: biased logits; top-k of the logits (or of the softmax, ``pre_softmax``), weights
    a softmax over the K logits (renormalised softmax); each token's experts evaluated one by one."""
    cfg = layer.config
    logits = x_TH @ layer.router.weight.t() + layer.router.bias
    if cfg.pre_softmax:
        probs = torch.softmax(logits, -1)
        top, ids = probs.topk(cfg.top_k, -1)
        weights = top / top.sum(-1, keepdim=True) if cfg.top_k > 1 else top
    else:
        top, ids = logits.topk(cfg.top_k, -1)
        weights = torch.softmax(top, -1)
    ex = layer.experts
    opts = SwiGLUOptions(cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_up_offset)
    rows = []
    for t in range(x_TH.shape[0]):
        y = 0
        for k in range(cfg.top_k):
            e = int(ids[t, k])
            h = x_TH[t : t + 1] @ ex.w13[e] + ex.b13[e]
            y = y + weights[t, k] * (act_spec(h, opts) @ ex.w2[e] + ex.b2[e])
        rows.append(y)
    return torch.cat(rows)


ROUTER_BIASES = {
    "random": None,
    "expert_3_never_picked": torch.tensor([0.0, 0.0, 0.0, -1e4, 0.0, 0.0]),
    "all_tokens_on_two_experts": torch.tensor([0.0, 1e4, 0.0, 1e4, 0.0, 0.0]),
}


@pytest.mark.parametrize("router_bias", sorted(ROUTER_BIASES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused_local_path", "dispatch_experts_combine"])
def test_layer_forward_and_every_gradient_match_plain_loops(fused: bool, router_bias: str) -> None:
    layer = _random_layer(_config(memory_efficient_permute=fused), ROUTER_BIASES[router_bias])
    reference = _random_layer(_config(memory_efficient_permute=fused), ROUTER_BIASES[router_bias])
    x = torch.randn(2, 15, H, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 15, H, generator=torch.Generator().manual_seed(2))
    xa, xr = _leaves(x, x)
    layer(xa).backward(grad)
    y_ref = layer_spec(reference, xr.view(-1, H)).view_as(x)
    y_ref.backward(grad)
    _close(layer(x), y_ref, "y")
    _close(xa.grad, xr.grad, "grad x")
    ref_params = dict(reference.named_parameters())
    names = sorted(n for n, _ in layer.named_parameters())
    assert {"router.bias", "experts.b13", "experts.b2"} <= set(names)
    for name, p in layer.named_parameters():
        _close(p.grad, ref_params[name].grad, f"grad {name}")
    counts = layer.last_tokens_per_expert
    if router_bias == "expert_3_never_picked":
        assert counts[3] == 0 and not layer.experts.b13.grad[3].any() and not layer.experts.b2.grad[3].any()
    if router_bias == "all_tokens_on_two_experts":
        assert counts[1] == counts[3] == 30 and counts.sum() == 60


def test_layer_top1_with_all_tokens_on_one_expert_matches_plain_loops() -> None:
    bias = torch.tensor([0.0, 0.0, 1e4, 0.0, 0.0, 0.0])
    layer = _random_layer(_config(top_k=1, pre_softmax=True), bias)
    reference = _random_layer(_config(top_k=1, pre_softmax=True), bias)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    layer(x).sum().backward()
    layer_spec(reference, x).sum().backward()
    assert layer.last_tokens_per_expert.tolist() == [0, 0, 9, 0, 0, 0]
    ref_params = dict(reference.named_parameters())
    for name, p in layer.named_parameters():
        _close(p.grad, ref_params[name].grad, f"grad {name}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused_local_path", "dispatch_experts_combine"])
def test_layer_on_no_tokens_gives_zero_gradients(fused: bool) -> None:
    layer = _random_layer(_config(memory_efficient_permute=fused))
    x = torch.zeros(0, H, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H)
    for name, p in layer.named_parameters():
        assert p.grad is None or not p.grad.any(), name


def test_the_options_change_the_output() -> None:
    """Each option is live: turning one off changes the layer's output on the same weights."""
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(3))
    full = _random_layer(_config())
    y = full(x)
    for changes in (dict(swiglu_limit=None), dict(swiglu_alpha=1.0), dict(swiglu_up_offset=0.0)):
        other = _random_layer(_config(**changes))
        other.load_state_dict(full.state_dict())
        assert not torch.allclose(other(x), y, atol=1e-4), changes
    for name in ("router.bias", "experts.b13", "experts.b2"):
        other = _random_layer(_config())
        other.load_state_dict(full.state_dict())
        with torch.no_grad():
            other.get_parameter(name).zero_()
        assert not torch.allclose(other(x), y, atol=1e-4), name


def test_defaults_add_no_parameters() -> None:
    layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=4, top_k=2))
    assert sorted(n for n, _ in layer.named_parameters()) == ["experts.w13", "experts.w2", "router.weight"]
    assert layer.config.plain_experts and layer.experts.swiglu.is_plain


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(swiglu_alpha=0.0), "swiglu_alpha=0.0 must be a finite number > 0"),
        (dict(swiglu_alpha=math.inf), "swiglu_alpha=inf"),
        (dict(swiglu_limit=-1.0), "swiglu_limit=-1.0 must be a finite number > 0, or None"),
        (dict(swiglu_up_offset=math.nan), "swiglu_up_offset=nan must be a finite number"),
        (dict(swiglu_up_offset="1"), "swiglu_up_offset='1' must be a finite number"),
        (dict(expert_mlp_bias=1), "expert_mlp_bias=1 is not a bool"),
        (dict(router_bias="yes"), "router_bias='yes' is not a bool"),
        (dict(fp8=Fp8Config()), "fp8 experts compute neither expert biases nor a scaled or clamped SwiGLU"),
    ],
    ids=["alpha_zero", "alpha_inf", "limit_negative", "offset_nan", "offset_str", "bias_int", "router_bias_str", "fp8"],
)
def test_bad_option_values_are_refused_naming_the_fix(changes: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        _config(**changes)


@pytest.mark.parametrize(
    "kwargs", [dict(mlp_bias=True), dict(swiglu=SwiGLUOptions(limit=7.0))], ids=["biases", "clamped_swiglu"]
)
def test_fp8_grouped_experts_refuse_the_options_at_construction(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="FP8 experts compute neither.*set fp8=None"):
        GroupedExperts(4, H, FF, fp8=Fp8Config(), **kwargs)


def test_fp8_switched_off_takes_the_options() -> None:
    assert isinstance(_config(fp8=Fp8Config(enabled="off")), MoEConfig)
    assert isinstance(GroupedExperts(4, H, FF, fp8=Fp8Config(enabled="off"), mlp_bias=True), nn.Module)


# ---- with activation recompute ------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused_local_path", "dispatch_experts_combine"])
def test_moe_act_recompute_rebuilds_the_biased_hidden_state_bitwise(fused: bool) -> None:
    import torch.nn.functional as F

    from lightning_moe.models.transformer import MoETransformer, TransformerConfig

    def step(recompute: list[str]) -> dict[str, torch.Tensor]:
        moe = _config(hidden_size=32, ffn_hidden_size=16, num_experts=4, memory_efficient_permute=fused,
                      experts_backend="loop")  # fmt: skip
        cfg = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, moe=moe, max_seq_len=16,
                                recompute=recompute)  # type: ignore[arg-type]  # fmt: skip
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("experts.b13", "experts.b2", "router.bias")):
                    p.normal_(0.0, 0.5)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    plain, rebuilt = step([]), step(["moe_act"])
    for name, value in plain.items():
        assert torch.equal(rebuilt[name], value), name


@pytest.mark.parametrize(
    "kwargs", [dict(mlp_bias=True), dict(swiglu=SwiGLUOptions(alpha=1.702))], ids=["biases", "scaled_swiglu"]
)
def test_echo_clones_refuse_experts_with_the_options(kwargs: dict) -> None:
    from types import SimpleNamespace

    from lightning_moe.moe.dispatch.echo import EchoDispatcher

    experts = GroupedExperts(8, 16, 8, backend="loop", **kwargs)
    with pytest.raises(NotImplementedError, match="clone experts compute the plain SwiGLU.*drop the ECHO callback"):
        EchoDispatcher(SimpleNamespace(etp_group=None), experts, 1)  # type: ignore[arg-type]


# ---- sharding and checkpoint layout -----------------------------------------------------------


@pytest.mark.parametrize(("ep", "etp"), [(2, 1), (1, 2), (2, 2)])
def test_sharded_biases_sum_to_the_full_experts_over_etp_ranks(ep: int, etp: int) -> None:
    """Each (EP, ETP) rank's experts on its rows, with its local weights and biases as
    ``_shard_experts`` lays them out; the ETP partial outputs (summed, as the dispatchers reduce
    them) equal the full experts' output: the down bias is added once, not once per ETP rank."""
    from lightning_moe.parallel.parallelize import shard_expert_biases, shard_expert_weights

    E, counts = 4, [3, 0, 5, 2]
    full = GroupedExperts(E, H, FF, backend="loop", mlp_bias=True, swiglu=GPT_OSS)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(sum(counts), H, generator=g)
    w_R = torch.rand(sum(counts), generator=g) + 0.1
    want = full(x, torch.tensor(counts), w_R)
    e = E // ep
    for ep_rank in range(ep):
        rows = slice(sum(counts[: ep_rank * e]), sum(counts[: (ep_rank + 1) * e]))
        local_counts = torch.tensor(counts[ep_rank * e : (ep_rank + 1) * e])
        partial = 0
        for etp_rank in range(etp):
            rank = dict(ep_rank=ep_rank, ep=ep, etp_rank=etp_rank, etp=etp)
            local = GroupedExperts(e, H, FF // etp, backend="loop", mlp_bias=True, swiglu=GPT_OSS)
            tensors = (*shard_expert_weights(full.w13.detach(), full.w2.detach(), **rank),
                       *shard_expert_biases(full.b13.detach(), full.b2.detach(), **rank))  # fmt: skip
            local.b2 = nn.Parameter(tensors[3])  # [e, H/etp]: this rank's columns of the down bias
            local.hidden_size = H
            local.down_bias_offset = etp_rank * (H // etp)
            with torch.no_grad():
                for name, value in zip(("w13", "w2", "b13"), tensors[:3]):
                    getattr(local, name).copy_(value)
            partial = partial + local(x[rows], local_counts, w_R[rows])
        _close(partial, want[rows], f"ep_rank {ep_rank}")


def test_shard_expert_biases_refuses_a_hidden_size_etp_does_not_divide() -> None:
    from lightning_moe.parallel.parallelize import shard_expert_biases

    with pytest.raises(ValueError, match="hidden size 6 is not divisible by etp=4"):
        shard_expert_biases(torch.zeros(4, 8), torch.zeros(4, 6), ep_rank=0, ep=1, etp_rank=0, etp=4)


def test_checkpoint_splits_and_joins_the_up_projection_bias_like_w13() -> None:
    from lightning_moe.checkpoint.experts import join_model_state, split_model_state, w13_names
    from lightning_moe.export import join_w13

    layer = _random_layer(_config())
    names = w13_names(layer)
    assert names == {"experts.w13", "experts.b13"}
    state = layer.state_dict()
    split = split_model_state(state, names)
    assert torch.equal(split["experts.b13.gate"], state["experts.b13"][:, :FF])
    assert torch.equal(split["experts.b13.up"], state["experts.b13"][:, FF:])
    for joined in (join_model_state(split, state, names), join_w13(split)):
        assert sorted(joined) == sorted(state) and all(torch.equal(joined[k], v) for k, v in state.items())
    assert w13_names(MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=4, top_k=2))) == {"experts.w13"}


def test_expert_and_router_biases_get_no_weight_decay() -> None:
    from lightning_moe.lit import MoELanguageModel
    from lightning_moe.models.transformer import TransformerConfig

    moe = _config(hidden_size=16, ffn_hidden_size=8, num_experts=4)
    lm = MoELanguageModel(TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, moe=moe,
                                            max_seq_len=8), weight_decay=0.3)  # fmt: skip
    decay, no_decay = lm.configure_optimizers()["optimizer"].param_groups
    by_id = {id(p): n for n, p in lm.named_parameters()}
    undecayed = {by_id[id(p)] for p in no_decay["params"]}
    assert {n for n in by_id.values() if n.endswith(("experts.b13", "experts.b2", "router.bias"))} <= undecayed
    assert any(by_id[id(p)].endswith("experts.w13") for p in decay["params"])
