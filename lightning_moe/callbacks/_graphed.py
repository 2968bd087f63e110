"""Modules as CUDA graphs: one forward graph and one backward graph each (used by ``CUDAGraphCapture``).

The same idea as ``torch.cuda.make_graphed_callables``, with two differences that matter inside a
training loop that already ran eager steps:

* The graphs are captured against detached *aliases* of the parameters (same storage, fresh
  autograd leaves). The real parameters' gradient accumulators were created on the default stream
  by the eager steps and may still be alive (a previous loss kept by the loop); a capture that
  reaches them makes autograd synchronise with the default stream, which invalidates the capture.
  The aliases' accumulators belong to the capture alone; the replay hands the gradients to the real
  parameters through an autograd function that takes them as inputs.
* Capture runs in ``thread_local`` error mode, so another thread's CUDA calls (a pinned-memory
  data-loader thread, say) cannot invalidate it.

Forward graphs are captured in call order and backward graphs in reverse order, in one memory
pool, so they must be replayed in that order: each module once per forward/backward pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["capture_modules"]


@dataclass
class _Graphs:
    """What one captured module replays, and the static buffers its graphs read and write."""

    params: list[torch.Tensor]  # the real parameters whose gradients the backward graph computes
    static_inputs: tuple[torch.Tensor, ...]
    static_outputs: list[torch.Tensor]
    output_spec: TreeSpec
    differentiable: list[bool]  # per output: did it require grad at capture
    static_grad_outputs: list[torch.Tensor | None]
    static_grads: list[torch.Tensor | None]  # inputs that require grad, then params
    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph | None = None
    group: _Group | None = None  # the modules captured together (one memory pool)


@dataclass
class _Group:
    """Modules captured in one pool. ``grads_handed_out``: a backward replay ran since the last check."""

    members: list[_Graphs]
    grads_handed_out: bool = False


class _GraphReplay(torch.autograd.Function):
    """Forward: copy the inputs in, replay. Backward: copy the output grads in, replay."""

    @staticmethod
    def forward(ctx: Any, graphs: _Graphs, *inputs_then_params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        group = graphs.group
        if group is not None and group.grads_handed_out:  # first forward replay after a backward one
            for member in group.members:
                _unalias_accumulated_grads(member)
            group.grads_handed_out = False
        for static, x in zip(graphs.static_inputs, inputs_then_params):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        graphs.forward_graph.replay()
        ctx.graphs = graphs
        outputs = tuple(o.detach() for o in graphs.static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, graphs.differentiable) if not d))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        graphs: _Graphs = ctx.graphs
        if graphs.backward_graph is None:
            raise RuntimeError("CUDAGraphCapture: a captured module with no differentiable output got a gradient.")
        for static, grad in zip(graphs.static_grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        _unalias_accumulated_grads(graphs)
        graphs.backward_graph.replay()
        if graphs.group is not None:
            graphs.group.grads_handed_out = True
        computed = iter(graphs.static_grads)
        result: list[torch.Tensor | None] = [None]  # for ``graphs``
        for x in graphs.static_inputs:
            result.append(next(computed) if x.requires_grad else None)
        result.extend(next(computed) for _ in graphs.params)
        return tuple(None if g is None else g.detach() for g in result)


def _unalias_accumulated_grads(graphs: _Graphs) -> None:
    """Give a parameter whose ``.grad`` is a static gradient buffer a copy of it.

    Autograd keeps a returned gradient as ``p.grad`` when ``p.grad`` was None. That buffer lives in
    the graphs' pool: the backward graph rewrites it, and the forward graphs, captured earlier, may
    reuse its addresses for their temporaries. Kept into the next forward/backward (micro-batches,
    ``zero_grad(set_to_none=False)``), it would be overwritten before autograd adds to it. So, once
    per step, before the first forward replay (and before a backward replay, for its own buffers),
    such a ``.grad`` is copied out; with ``set_to_none=True`` there is nothing to copy.
    """
    for p, static in zip(graphs.params, graphs.static_grads[len(graphs.static_grads) - len(graphs.params) :]):
        grad = p.grad
        if grad is not None and static is not None and grad.untyped_storage().data_ptr() == static.untyped_storage().data_ptr():
            p.grad = grad.clone()


def _differentiable(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [o for o in outputs if o.requires_grad]


class _Capturable:
    """Modules run against detached aliases of their parameters on static copies of their samples."""

    def __init__(self, modules: Sequence[nn.Module], samples: Sequence[tuple[torch.Tensor, ...]]) -> None:
        self.modules = modules
        self.aliases = [
            {name: p.detach().requires_grad_(True) for name, p in m.named_parameters() if p.requires_grad}
            for m in modules
        ]
        self.params = [[p for _, p in m.named_parameters() if p.requires_grad] for m in modules]
        self.static_inputs = [tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in s) for s in samples]

    def run(self, i: int) -> Any:
        return functional_call(self.modules[i], self.aliases[i], self.static_inputs[i], strict=False)

    def grad_inputs(self, i: int) -> list[torch.Tensor]:
        return [x for x in self.static_inputs[i] if x.requires_grad] + list(self.aliases[i].values())


def _warm_up(modules: _Capturable, warmup_iters: int) -> None:
    """Forward and backward of every module ``warmup_iters`` times on a side stream, as capture will run."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture will run
        for i in range(len(modules.modules)):
            for _ in range(warmup_iters):
                outputs = _differentiable(tree_flatten(modules.run(i))[0])
                if outputs:
                    torch.autograd.grad(
                        outputs, modules.grad_inputs(i), [torch.ones_like(o) for o in outputs], allow_unused=True
                    )
            del outputs
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture_forward(modules: _Capturable, i: int, pool: Any) -> _Graphs:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        flat, spec = tree_flatten(modules.run(i))
    if not all(isinstance(o, torch.Tensor) for o in flat):
        raise TypeError(f"CUDAGraphCapture: {type(modules.modules[i]).__name__} returns non-tensor outputs.")
    return _Graphs(
        params=modules.params[i],
        static_inputs=modules.static_inputs[i],
        static_outputs=flat,
        output_spec=spec,
        differentiable=[o.requires_grad for o in flat],
        static_grad_outputs=[torch.empty_like(o) if o.requires_grad else None for o in flat],
        static_grads=[],
        forward_graph=graph,
    )


def _capture_backward(modules: _Capturable, i: int, graphs: _Graphs, pool: Any) -> None:
    outputs = _differentiable(graphs.static_outputs)
    if not outputs:
        return
    grad_outputs = [g for g in graphs.static_grad_outputs if g is not None]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        grads = torch.autograd.grad(outputs, modules.grad_inputs(i), grad_outputs, allow_unused=True)
    graphs.static_grads = list(grads)
    graphs.backward_graph = graph
    graphs.static_outputs = [o.detach() for o in graphs.static_outputs]  # drop the capture's autograd graph


def _replayer(graphs: _Graphs) -> Callable[..., Any]:
    def replay(*args: torch.Tensor) -> Any:
        outputs = _GraphReplay.apply(graphs, *args, *graphs.params)
        return tree_unflatten(list(outputs), graphs.output_spec)

    return replay


def capture_modules(
    modules: Sequence[nn.Module], samples: Sequence[tuple[torch.Tensor, ...]], warmup_iters: int = 3
) -> list[Callable[..., Any]]:
    """Capture each module's forward and backward; returns one replaying callable per module.

    ``samples`` give each module's positional tensor arguments (shapes, dtypes and
    ``requires_grad`` are what the replay accepts). Buffers are used in place, so a warm-up that
    updates them (MoE statistics) should be undone by the caller.
    """
    capturable = _Capturable(modules, samples)
    _warm_up(capturable, warmup_iters)
    pool = torch.cuda.graph_pool_handle()
    captured = [_capture_forward(capturable, i, pool) for i in range(len(modules))]
    for i in reversed(range(len(modules))):
        _capture_backward(capturable, i, captured[i], pool)
    group = _Group(captured)
    for graphs in captured:
        graphs.group = group
    return [_replayer(g) for g in captured]
