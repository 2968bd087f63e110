"""Unit tests for lightning_moe/callbacks/cuda_graphs.py on CPU.

No graph can be captured here; what is checked: the no-op info line with a real Trainer, every
refusal (dynamic MoE, recompute, autocast, names), the module choice, the replay guard (shape
change -> eager + one warning) with a stand-in graph, the gradient-accumulation guard against
the static-buffer aliasing of the graph replay, and that a static MoE layer's forward
and backward contain no host sync (the precondition for capture).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _callback_models import tiny_config, tiny_trainer, token_loader
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_moe.ops.permute as permute_ops
from lightning_moe import MoEConfig, MoELayer
from lightning_moe.callbacks._graphed import _GraphReplay, _Graphs, _Group
from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture, _Replay, _Target
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import MoETransformer

STATIC = dict(capacity_factor=1.5, pad_to_capacity=True)


def _names(cb: CUDAGraphCapture) -> list[str]:
    return [t.name for t in cb.targets]


def test_callback_is_a_noop_with_one_info_line_on_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = CUDAGraphCapture(warmup_steps=1)
    with caplog.at_level(logging.INFO):
        tiny_trainer(tmp_path, [cb], max_steps=3).fit(MoELanguageModel(tiny_config()), token_loader())
    lines = [r.getMessage() for r in caplog.records if "CUDAGraphCapture" in r.getMessage()]
    assert lines == [
        "CUDAGraphCapture: the root device is cpu, not CUDA: there is nothing to capture, so the callback is a no-op."
    ]
    assert cb.captured == [] and not cb._hooks


def test_auto_takes_attention_routers_of_dynamic_layers_and_static_layers_whole() -> None:
    cb = CUDAGraphCapture()
    cb.attach(MoETransformer(tiny_config()), "cpu")
    assert _names(cb) == ["layers.0.attn", "layers.0.ffn.router", "layers.1.attn", "layers.1.ffn.router"]
    cb.attach(MoETransformer(tiny_config(**STATIC)), "cpu")
    assert _names(cb) == ["layers.0.attn", "layers.0.ffn", "layers.1.attn", "layers.1.ffn"]


@pytest.mark.parametrize("patterns", [["*.ffn"], ["layers.*"], ["*.ffn.experts"]])
def test_dynamic_moe_layer_is_refused_with_the_fix(patterns: list[str]) -> None:
    cb = CUDAGraphCapture(modules=patterns)
    with pytest.raises(ValueError, match=r"capacity_factor=None, pad_to_capacity=False.*pad_to_capacity=True"):
        cb.attach(MoETransformer(tiny_config()), "cpu")


def test_capacity_without_padding_is_refused() -> None:
    with pytest.raises(ValueError, match=r"capacity_factor=1.25, pad_to_capacity=False"):
        CUDAGraphCapture(modules=["*.ffn"]).attach(MoETransformer(tiny_config(capacity_factor=1.25)), "cpu")


def test_routers_of_a_dynamic_layer_are_accepted() -> None:
    cb = CUDAGraphCapture(modules=["*.router", "*.attn"])
    cb.attach(MoETransformer(tiny_config()), "cpu")
    assert _names(cb) == ["layers.0.attn", "layers.0.ffn.router", "layers.1.attn", "layers.1.ffn.router"]


@pytest.mark.parametrize(
    ("recompute", "patterns"), [(["attn"], ["*.attn"]), (["moe"], ["*.ffn"]), (["block"], ["*.router"])]
)
def test_module_rerun_by_recompute_is_refused(recompute: list[str], patterns: list[str]) -> None:
    cfg = tiny_config(**STATIC)
    cfg.recompute = recompute  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"re-run in backward by TransformerConfig.recompute=.*drop it from recompute"):
        CUDAGraphCapture(modules=patterns).attach(MoETransformer(cfg), "cpu")


def test_autocast_precision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"precision='bf16-mixed' runs the model under torch.autocast.*'bf16-true'"):
        tiny_trainer(tmp_path, [CUDAGraphCapture()], precision="bf16-mixed").fit(
            MoELanguageModel(tiny_config()), token_loader()
        )


def test_unknown_pattern_raises_listing_names() -> None:
    with pytest.raises(ValueError, match=r"pattern '\*\.mlp' matches no sub-module.*'layers\.\*\.ffn\.router'"):
        CUDAGraphCapture(modules=["*.mlp"]).attach(MoETransformer(tiny_config()), "cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(warmup_steps=0), r"warmup_steps=0 must be an int >= 1"),
        (dict(modules="*.attn"), r"modules='\*.attn' must be a list; write modules=\['\*.attn'\]"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CUDAGraphCapture(**kwargs)


# --- replay guard, with a stand-in for the graph ---------------------------------------------------


def _replay_for(layer: MoELayer, x: torch.Tensor) -> tuple[_Replay, list[str]]:
    cb = CUDAGraphCapture()
    target = _Target("ffn", layer, signature=((tuple(x.shape), x.dtype, x.device, True),), order=0)
    target.moe_layers = [layer]
    calls: list[str] = []

    def graphed(*args: Any) -> Any:
        calls.append("graph")
        return MoELayer.forward(layer, *args)

    def eager(*args: Any) -> Any:
        calls.append("eager")
        return MoELayer.forward(layer, *args)

    return _Replay(cb, target, graphed, eager), calls


def test_replay_falls_back_to_eager_on_a_shape_change_with_one_warning() -> None:
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, **STATIC))
    replay, calls = _replay_for(layer, torch.randn(6, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replay(torch.randn(6, 8, requires_grad=True))
        replay(torch.randn(5, 8, requires_grad=True))
        replay(torch.randn(4, 8, requires_grad=True))
        replay(torch.randn(6, 8, requires_grad=True))
        with torch.no_grad():
            replay(torch.randn(6, 8))
    assert calls == ["graph", "eager", "eager", "graph", "eager"]
    shape = [str(w.message) for w in caught if "shape change" in str(w.message)]
    assert len(shape) == 1 and "[5, 8] float32" in shape[0] and "[6, 8] float32" in shape[0]


def test_replay_runs_eager_when_the_aux_loss_scale_changes() -> None:
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, **STATIC))
    replay, calls = _replay_for(layer, torch.randn(6, 8))
    layer.aux_loss_scale = 0.5
    with pytest.warns(UserWarning, match=r"new aux_loss_scale"):
        replay(torch.randn(6, 8, requires_grad=True))
    assert calls == ["eager"]


def test_replay_runs_eager_with_one_warning_while_a_routing_override_is_set() -> None:
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, **STATIC))
    replay, calls = _replay_for(layer, torch.randn(6, 8))
    layer.router.set_routing_override(lambda ids_TK: ids_TK)
    with pytest.warns(UserWarning, match=r"ffn has a routing override set"):
        replay(torch.randn(6, 8, requires_grad=True))
    layer.router.set_routing_override(None)
    replay(torch.randn(6, 8, requires_grad=True))
    assert calls == ["eager", "graph"]


def test_replay_runs_eager_silently_in_the_other_training_mode() -> None:
    """Captured in training mode (dropout, aux losses): an eval-mode call under grad runs eager."""
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, **STATIC))
    replay, calls = _replay_for(layer, torch.randn(6, 8))
    assert replay.target.training
    layer.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay(torch.randn(6, 8, requires_grad=True))
    layer.train()
    replay(torch.randn(6, 8, requires_grad=True))
    assert calls == ["eager", "graph"]


class _FakeGraph:
    """Stands in for a captured graph on CPU: replay runs a function writing static buffers."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.replay = fn


def _scale_by_parameter(forward_temporaries_reuse_grad: bool) -> tuple[_Graphs, torch.nn.Parameter, torch.Tensor]:
    """Graphs of ``y = x * p`` (four elements) whose replays are Python functions.

    ``forward_temporaries_reuse_grad``: the forward "graph" first scribbles over the static
    gradient buffer, as a forward captured before the backward may place temporaries there.
    """
    p = torch.nn.Parameter(torch.ones(4))
    x_static, y_static, go_static, gp_static = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)

    def forward() -> None:
        if forward_temporaries_reuse_grad:
            gp_static.fill_(-100.0)
        y_static.copy_(x_static * p.detach())

    graphs = _Graphs(
        params=[p],
        static_inputs=(x_static,),
        static_outputs=[y_static],
        output_spec=tree_flatten([y_static])[1],
        differentiable=[True],
        static_grad_outputs=[go_static],
        static_grads=[gp_static],
        forward_graph=_FakeGraph(forward),  # type: ignore[arg-type]
        backward_graph=_FakeGraph(lambda: gp_static.copy_(go_static * x_static)),  # type: ignore[arg-type]
    )
    graphs.group = _Group([graphs])
    return graphs, p, gp_static


def test_replay_keeps_static_gradient_buffers_out_of_accumulated_grads() -> None:
    """The replay's backward returns one static buffer every time; accumulation must stay right."""
    graphs, p, gp_static = _scale_by_parameter(forward_temporaries_reuse_grad=False)
    graphs.group = None  # the backward's own check alone
    for scale in (1.0, 3.0):
        (y,) = _GraphReplay.apply(graphs, torch.full((4,), 2.0), p)
        torch.testing.assert_close(y, torch.full((4,), 2.0))
        (y.sum() * scale).backward()
    # d/dp of sum(x * p) * scale is x * scale: 2 + 6. Without the copy, the second replay would
    # overwrite p.grad (the static buffer) with 6 and autograd would add it to itself: 12.
    assert torch.equal(p.grad, torch.full((4,), 8.0))
    assert p.grad.untyped_storage().data_ptr() != gp_static.untyped_storage().data_ptr()


def test_forward_replay_reusing_the_gradient_addresses_leaves_accumulated_grads_intact() -> None:
    """A forward graph captured before the backward one may use the static gradient's addresses
    for its temporaries: the ``.grad`` autograd kept from the last backward must be copied out
    before the next forward replay, not only before the next backward replay."""
    graphs, p, _ = _scale_by_parameter(forward_temporaries_reuse_grad=True)
    for scale in (1.0, 3.0):  # two micro-batches, no zero_grad in between
        (y,) = _GraphReplay.apply(graphs, torch.full((4,), 2.0), p)
        (y.sum() * scale).backward()
    assert torch.equal(p.grad, torch.full((4,), 8.0))


# --- a static MoE layer has no host sync (what capture needs) -------------------------------------

_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.bincount.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
}


class _SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        bool_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        if func in _SYNC_OPS or bool_index:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_static_moe_layer_forward_and_backward_have_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # The capacity guard is a device-side assert on CUDA; on CPU it is a checked ValueError.
    monkeypatch.setattr(permute_ops, "_check_capacity", lambda counts, capacity: None)
    cfg = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, experts_backend="torch", **STATIC)
    layer = MoELayer(cfg)
    x = torch.randn(2, 12, 32, requires_grad=True)
    with _SyncSpy() as spy:
        y = layer(x)
        y.square().sum().backward()
    assert spy.syncs == []
    assert layer.router.weight.grad is not None and layer.experts.w13.grad is not None
