"""Unit tests for lightning_moe/models/recompute.py: exact losses and gradients, real rebuilds, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.models.recompute import RecomputePlan, RecomputeScope, validate_recompute
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.moe.utils import find_moe_layers


def _config(recompute: list[str], dtype_router: str = "float32", **moe: Any) -> TransformerConfig:
    moe_cfg = MoEConfig(
        hidden_size=32,
        ffn_hidden_size=16,
        num_experts=4,
        top_k=2,
        experts_backend="loop",
        router_dtype=dtype_router,  # type: ignore[arg-type]
        **moe,
    )
    return TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        moe=moe_cfg,
        max_seq_len=16,
        recompute=recompute,  # type: ignore[arg-type]
    )


def _step(cfg: TransformerConfig, dtype: torch.dtype = torch.float32, steps: int = 2) -> tuple[list, dict, dict]:
    """Two forward/backward passes (grads accumulate) of a seeded model; losses, grads, MoE buffers."""
    torch.manual_seed(0)
    model = MoETransformer(cfg).to(dtype)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return losses, grads, buffers


def _assert_identical(a: tuple[list, dict, dict], b: tuple[list, dict, dict]) -> None:
    for la, lb in zip(a[0], b[0]):
        assert torch.equal(la, lb), (la, lb)
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"gradient of {name} differs"
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), f"buffer {name} differs"


TARGETS = [["norm"], ["moe_act"], ["moe_act", "norm"], ["moe"], ["attn"], ["block"], ["norm", "moe_act", "attn"]]


@pytest.mark.parametrize("recompute", TARGETS, ids=["+".join(t) for t in TARGETS])
def test_recompute_gives_identical_losses_grads_and_buffers(recompute: list[str]) -> None:
    # expert bias + global aux loss: forward side effects that a recompute must not repeat
    moe = dict(expert_bias=True, aux_loss="global", z_loss_coeff=1e-3)
    _assert_identical(_step(_config([], **moe)), _step(_config(recompute, **moe)))


def test_recompute_identical_with_capacity_padding_and_shared_expert() -> None:
    moe = dict(capacity_factor=1.0, pad_to_capacity=True, shared_expert_ffn_size=8, shared_expert_gate=True)
    _assert_identical(_step(_config([], **moe)), _step(_config(["moe_act", "norm"], **moe)))


@pytest.mark.parametrize("router_dtype", ["float32", "bfloat16"])
def test_recompute_identical_in_bfloat16(router_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 model: with an fp32 router, the router's fp32 copy of its input is rebuilt too."""
    casts = [0]
    original = RecomputeScope._cast_of_registered

    def counting(self: RecomputeScope, t: torch.Tensor) -> Any:
        entry = original(self, t)
        casts[0] += entry is not None
        return entry

    base = _step(_config([], dtype_router=router_dtype), dtype=torch.bfloat16)
    monkeypatch.setattr(RecomputeScope, "_cast_of_registered", counting)
    _assert_identical(base, _step(_config(["moe_act", "norm"], dtype_router=router_dtype), dtype=torch.bfloat16))
    assert casts[0] == (4 if router_dtype == "float32" else 0)  # 2 layers x 2 steps


def test_recompute_identical_under_cpu_autocast() -> None:
    """Under autocast the expert input is a bf16 cast of the dispatched rows: matched by its graph."""

    def run(recompute: list[str]) -> tuple[list, dict, dict]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(_config(recompute))

    _assert_identical(run([]), run(["moe_act", "norm"]))


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_moe_act_rebuilds_the_expert_hidden_state_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.models.recompute as recompute_mod

    calls = _count_calls(monkeypatch, recompute_mod, "gmm")
    _step(_config([]), steps=1)
    assert calls[0] == 0
    _step(_config(["moe_act"]), steps=1)
    assert calls[0] == 2  # one x_RH @ w13 per MoE layer, in backward


def test_moe_act_regathers_rows_on_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.models.recompute as recompute_mod

    calls = _count_calls(monkeypatch, recompute_mod, "permute_rows_reference")
    base = _step(_config([], memory_efficient_permute=False), steps=1)
    assert calls[0] == 0
    _assert_identical(base, _step(_config(["moe_act", "norm"], memory_efficient_permute=False), steps=1))
    assert calls[0] == 2  # one re-gather of x_RH per MoE layer


def test_norm_recompute_rebuilds_each_norm_output_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.models.recompute as recompute_mod

    rebuilds = [0]
    original = recompute_mod._norm_recipe

    def counting_recipe(norm: Any, x: torch.Tensor) -> Any:
        recipe = original(norm, x)

        def counted() -> torch.Tensor:
            rebuilds[0] += 1
            return recipe()

        return counted

    monkeypatch.setattr(recompute_mod, "_norm_recipe", counting_recipe)
    model = MoETransformer(_config(["norm"]))
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert rebuilds[0] == 4  # 2 blocks x 2 norms, each rebuilt once for all of its consumers


def test_plan_is_inert_without_grad() -> None:
    scope = RecomputeScope(RecomputePlan(norm=True, moe_act=True))
    with torch.no_grad(), RecomputeScope(RecomputePlan(norm=True)) as inert:
        assert not inert.active
    assert scope.active


def test_recompute_with_no_grad_forward_matches() -> None:
    torch.manual_seed(0)
    a = MoETransformer(_config([]))
    torch.manual_seed(0)
    b = MoETransformer(_config(["moe_act", "norm", "attn"]))
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_recompute_leaves_moe_published_values_of_the_forward() -> None:
    model = MoETransformer(_config(["moe"]))
    ids = torch.randint(0, 64, (2, 8))
    loss = model(ids).sum()
    before = {n: layer.last_tokens_per_expert for n, layer in find_moe_layers(model)}
    loss.backward()
    after = {n: layer.last_tokens_per_expert for n, layer in find_moe_layers(model)}
    assert all(before[n] is after[n] for n in before)


@pytest.mark.parametrize(
    ("recompute", "match"),
    [
        (["norms"], r"'norms' is unknown; choose from \['norm', 'moe_act', 'moe', 'attn', 'block'\]"),
        (["norm", "norm"], r"lists 'norm' twice"),
        (["block", "norm"], r"recompute=\['block', 'norm'\] combines 'block'.*use recompute=\['block'\] alone"),
        (["moe", "moe_act"], r"combines 'moe' with 'moe_act'.*drop 'moe_act'"),
    ],
)
def test_bad_recompute_lists_raise_at_construction(recompute: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(recompute)


def test_recompute_given_as_a_string_raises() -> None:
    with pytest.raises(ValueError, match=r"recompute='norm' must be a list of names; write recompute=\['norm'\]"):
        validate_recompute("norm")  # type: ignore[arg-type]


def test_rebuildable_tensors_are_freed_after_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With moe_act + norm nothing keeps the norm outputs or the experts' hidden state."""
    from torch.multiprocessing.reductions import StorageWeakRef

    import lightning_moe.models.recompute as recompute_mod

    model = MoETransformer(_config(["moe_act", "norm"]))
    refs: list[StorageWeakRef] = []
    for block in model.layers:
        for norm in (block.attn_norm, block.ffn_norm):
            norm.register_forward_hook(lambda m, i, out: refs.append(StorageWeakRef(out.untyped_storage())))
    original = recompute_mod.RecomputeScope._hidden_token

    def spy(self: RecomputeScope, t: torch.Tensor) -> Any:
        token = original(self, t)
        if token is not None:
            refs.append(StorageWeakRef(t.untyped_storage()))
        return token

    monkeypatch.setattr(recompute_mod.RecomputeScope, "_hidden_token", spy)
    loss = model(torch.randint(0, 64, (2, 8))).sum()
    assert len(refs) == 6 and all(r.expired() for r in refs)
    loss.backward()
