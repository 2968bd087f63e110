"""Unit tests for lightning_moe/callbacks/offload.py on CPU.

The callback is a no-op without CUDA (one info line); its engines run on any device, so here
they copy host to host: that checks the bookkeeping (groups, dedup, views, prefetch order,
chunked optimizer steps) for exact equality. tests/gpu checks the streams and the memory.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _callback_models import tiny_config, tiny_trainer, token_loader

from lightning_moe.callbacks._patterns import select_modules
from lightning_moe.callbacks.offload import ActivationOffloader, CPUOffload, OptimizerStateOffloader
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import MoETransformer

CPU = torch.device("cpu")


def _train(
    model: MoETransformer, steps: int = 2, offloader: Any = None, opt_offload: bool = False
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    streamer = None
    if opt_offload:
        streamer = OptimizerStateOffloader(opt, CPU, chunk_bytes=4096, min_tensor_bytes=64)
        streamer.attach()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=g)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
            loss.backward()
            return loss

        losses.append(opt.step(closure).detach())
    if streamer is not None:
        streamer.detach()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _model(**kw: Any) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(tiny_config(**kw))


def _assert_same(a: tuple[list, dict], b: tuple[list, dict]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), (a[0], b[0])
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


@pytest.mark.parametrize("patterns", [["*layers.*.*"], ["layers.*"], ["*.ffn"]], ids=["sublayers", "blocks", "ffn"])
def test_activation_offload_gives_identical_training(patterns: list[str]) -> None:
    base = _train(_model())
    model = _model()
    offloader = ActivationOffloader(select_modules("t", model, patterns, "activations"), CPU, min_tensor_bytes=0)
    offloader.attach()
    _assert_same(base, _train(model))
    assert offloader.offloaded_bytes > 0
    offloader.detach()


def _offloaded_bytes_without_budget() -> int:
    """Bytes one training step offloads with no budget (every block child's activations)."""
    model = _model()
    unlimited = ActivationOffloader(select_modules("t", model, ["*layers.*.*"], "activations"), CPU, min_tensor_bytes=0)
    unlimited.attach()
    _train(model, steps=1)
    everything = unlimited.offloaded_bytes
    unlimited.detach()
    return everything


def test_offload_budget_keeps_the_rest_on_the_device_and_training_identical() -> None:
    base = _train(_model())
    everything = _offloaded_bytes_without_budget()
    budget = everything // 3
    model = _model()
    capped = ActivationOffloader(
        select_modules("t", model, ["*layers.*.*"], "activations"), CPU, min_tensor_bytes=0, max_bytes_per_step=budget
    )
    capped.attach()
    _assert_same(base, _train(model))
    assert 0 < capped.offloaded_bytes <= budget < everything
    capped.detach()


def test_offload_budget_equal_to_the_full_size_offloads_everything() -> None:
    """The budget is inclusive: activations that sum to exactly ``max_bytes_per_step`` all leave."""
    everything = _offloaded_bytes_without_budget()
    model = _model()
    exact = ActivationOffloader(
        select_modules("t", model, ["*layers.*.*"], "activations"), CPU, min_tensor_bytes=0, max_bytes_per_step=everything
    )
    exact.attach()
    _train(model, steps=1)
    assert exact.offloaded_bytes == everything > 0
    exact.detach()


class _SliceSquare(torch.nn.Module):
    """``(x @ w)[:, :4] ** 2``: the product saves a 64-byte view of a 1 KiB storage."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = (x @ self.w)[:, :4]
        return s * s


def test_small_view_of_a_large_storage_stays_on_the_device() -> None:
    """Offloading copies whole storages: a view under half its storage is kept, its base not copied."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ref = _SliceSquare()
    ref(x).sum().backward()
    module = _SliceSquare()
    offloader = ActivationOffloader([("m", module)], CPU, min_tensor_bytes=0)
    offloader.attach()
    module(x).sum().backward()
    offloader.detach()
    assert offloader.offloaded_bytes == x.numel() * x.element_size()  # only x (saved for w's gradient)
    torch.testing.assert_close(module.w.grad, ref.w.grad, rtol=0, atol=0)


def test_offloaded_experts_rebuild_instead_of_copying_and_are_restored_on_detach() -> None:
    base = _train(_model())
    copied = {}
    for rebuild in (False, True):
        model = _model()
        experts = [m.ffn.experts for m in model.layers]
        offloader = ActivationOffloader(
            select_modules("t", model, ["layers.0.ffn", "layers.1.attn"], "activations"), CPU, min_tensor_bytes=0,
            rebuild_experts=rebuild,
        )
        offloader.attach()
        # only inside the selection; layers.1.attn, the last group, stays on the device: layers.0.ffn is copied
        assert [e.lean_backward for e in experts] == [True if rebuild else None, None]
        _assert_same(base, _train(model))
        copied[rebuild] = offloader.offloaded_bytes
        offloader.detach()
        assert [e.lean_backward for e in experts] == [None, None]
    assert copied[True] < copied[False]  # x_RH and a_RF no longer cross the host link


def test_activation_offload_composes_with_recompute() -> None:
    """Rebuildable tensors go to the recompute scope, the rest is offloaded; results unchanged."""
    base = _train(_model())
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.recompute = ["moe_act", "norm"]
    model = MoETransformer(cfg)
    for patterns in (["layers.*"], ["*layers.*.*"]):  # outside and inside the scope
        offloader = ActivationOffloader(select_modules("t", model, patterns, "activations"), CPU, min_tensor_bytes=0)
        offloader.attach()
        model.load_state_dict(_model().state_dict())
        _assert_same(base, _train(model))
        assert offloader.offloaded_bytes > 0
        offloader.detach()


def _fetch_order(
    monkeypatch: pytest.MonkeyPatch, patterns: list[str], prefetch: int, with_needs: bool = False, **kw: Any
) -> list:
    """(group name, prefetched?) in the order groups are brought back during the second step's backward;
    ``("needs", name)`` marks where backward first needs a group (fetched then unless already loaded)."""
    model = _model(**kw)
    offloader = ActivationOffloader(
        select_modules("t", model, patterns, "activations"), CPU, prefetch=prefetch, min_tensor_bytes=0
    )
    offloader.attach()
    order: list[tuple[str, bool]] = []
    original = ActivationOffloader._bring_back

    def spy(self: ActivationOffloader, group: Any, prefetch: bool) -> None:
        if not prefetch and with_needs:
            order.append(("needs", group.name))
        if not group.loaded:
            order.append((group.name, prefetch))
        original(self, group, prefetch)

    monkeypatch.setattr(ActivationOffloader, "_bring_back", spy)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):  # the second step keeps the last group on the device
        order.clear()
        model(ids).sum().backward()
    return order


def test_prefetch_brings_back_the_previous_group(monkeypatch: pytest.MonkeyPatch) -> None:
    order = _fetch_order(monkeypatch, ["layers.*"], prefetch=1)
    assert order == [("layers.0", True)]  # layers.1 stayed; layers.0 was prefetched during its backward


def test_prefetch_depth_brings_back_that_many_groups_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    patterns = ["*layers.*.*"]  # every block child: the groups alternate small (norms) and large modules
    names = [n for n, _ in select_modules("t", _model(num_layers=3), patterns, "activations")]
    *offloaded, kept = names  # the last group of a step stays on the device
    events = _fetch_order(monkeypatch, patterns, prefetch=3, with_needs=True, num_layers=3)
    # when backward first needs the kept group, the 3 groups before it are already on their way back
    assert events[:4] == [("needs", kept)] + [(n, True) for n in offloaded[-1:-4:-1]]
    # afterwards each group's arrival prefetches the one 3 further back; none is fetched on demand
    fetched = [e for e in events if e[0] != "needs"]
    assert fetched == [(n, True) for n in reversed(offloaded)]
    assert events.index((offloaded[-4], True)) == events.index(("needs", offloaded[-1])) + 1
    on_demand = _fetch_order(monkeypatch, patterns, prefetch=0, num_layers=3)
    assert on_demand == [(n, False) for n in reversed(offloaded)]


@pytest.mark.parametrize("prefetch", [-1, True, 1.5])
def test_bad_prefetch_is_refused_naming_the_value(prefetch: Any) -> None:
    with pytest.raises(ValueError, match=f"prefetch={prefetch!r}"):
        CPUOffload(prefetch=prefetch)
    with pytest.raises(ValueError, match=f"prefetch={prefetch!r}"):
        ActivationOffloader([], CPU, prefetch=prefetch)


def test_pinned_allocation_failure_falls_back_with_one_warning() -> None:
    base = _train(_model())
    model = _model()
    offloader = ActivationOffloader(
        select_modules("t", model, ["*layers.*.*"], "activations"), CPU, min_tensor_bytes=0, pin_memory=True
    )
    offloader.attach()
    if torch.cuda.is_available():  # pinning works there; force the failure
        offloader._host.pin = True
        offloader._host.empty = _failing_then(offloader._host.empty)  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(model)
    messages = [str(w.message) for w in caught if "pinned host memory" in str(w.message)]
    assert len(messages) == 1 and "falling back to pageable host memory" in messages[0]
    _assert_same(base, result)


def _failing_then(empty: Any) -> Any:  # pragma: no cover - only on machines with CUDA
    def fail(numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory (simulated)")

    return fail


def test_optimizer_state_offload_matches_one_step_over_all_parameters() -> None:
    base = _train(_model(), steps=3)
    got = _train(_model(), steps=3, opt_offload=True)
    _assert_same(base, got)


def test_optimizer_state_offload_keeps_states_off_the_device_between_steps() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    streamer = OptimizerStateOffloader(opt, CPU, chunk_bytes=4096, min_tensor_bytes=64)
    streamer.attach()
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    big = [v for s in opt.state.values() for v in s.values() if v.numel() * v.element_size() >= 64]
    assert big and all(id(v) in streamer._ours for v in big)  # the host copies, not device tensors
    assert streamer.state_bytes_on_device() == 0
    assert set(opt.state_dict()["state"]) == set(range(len(list(model.parameters()))))
    streamer.detach()
    assert "step" not in vars(opt) and not streamer._ours


# --- the Lightning callback ----------------------------------------------------------------------


def test_callback_is_a_noop_with_one_info_line_on_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        cb = CPUOffload(optimizer_states=True)
        tiny_trainer(tmp_path, [cb], max_steps=2).fit(MoELanguageModel(tiny_config()), token_loader())
    lines = [r.getMessage() for r in caplog.records if "CPUOffload" in r.getMessage()]
    assert lines == [
        "CPUOffload: the root device is cpu, not CUDA: there is no device memory to free, so the callback is a no-op."
    ]
    assert cb.activation_offloader is None and cb.optimizer_offloaders == []


def test_unknown_module_pattern_raises_listing_names(tmp_path: Path) -> None:
    cb = CPUOffload(activations=["*layers.*.mlp"])
    with pytest.raises(
        ValueError, match=r"pattern '\*layers\.\*\.mlp' matches no sub-module.*'model\.layers\.\*\.ffn'"
    ):
        tiny_trainer(tmp_path, [cb], max_steps=1).fit(MoELanguageModel(tiny_config()), token_loader())


def test_model_without_moe_layers_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"CPUOffload: Linear holds no lightning_moe MoELayer"):
        CPUOffload().attach(torch.nn.Linear(2, 2), "cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(activations="layers.*"), r"activations='layers.\*' must be a list; write activations=\['layers.\*'\]"),
        (dict(min_tensor_bytes=-1), r"min_tensor_bytes=-1 must be >= 0"),
        (dict(max_offload_gib=0), r"max_offload_gib=0 must be > 0 \(or None for no limit\)"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffload(**kwargs)


def test_optimizer_state_offloader_step_before_attach_names_the_fix() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    offloader = OptimizerStateOffloader(torch.optim.Adam([w]), CPU)
    with pytest.raises(RuntimeError, match=r"called before attach\(\).*wrap_optimizers"):
        offloader.step()
