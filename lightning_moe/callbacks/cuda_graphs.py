"""CUDAGraphCapture: replay the static-shape regions of a step as CUDA graphs.

A launch-bound step (small micro-batch, many small kernels: routing, permutation, norms) spends
its time in the CPU launching kernels; a captured graph replays a whole region with one launch.

Stages:

1. ``setup``: the modules to capture are resolved and checked. ``modules=None`` (auto) takes
   every attention sublayer, every MoE layer whose shapes are static (``capacity_factor`` and
   ``pad_to_capacity=True``: ``E·capacity`` rows every step), and the router of every other MoE
   layer. Explicit ``modules`` are fnmatch patterns on qualified names. A region holding a
   dropless (dynamic-shape) MoE layer, a module that ``recompute`` re-runs, or an autocast
   precision are refused with the fix. Without CUDA: one info line, then nothing.
2. The first ``warmup_steps`` training steps run eager while forward pre-hooks note each module's
   call signature (shapes, dtypes, ``requires_grad``) and the order of first calls.
3. Before step ``warmup_steps + 1``: each module runs once eager under
   ``torch.cuda.set_sync_debug_mode("error")``; one that synchronizes with the host cannot be
   captured and stays eager (one warning naming it). The rest are captured together by
   ``_graphed.capture_modules`` in forward order (one memory pool; see there why not
   ``torch.cuda.make_graphed_callables``). The MoE bookkeeping
   buffers are restored afterwards, since capture runs warm-up iterations.
4. Each later call replays the graph when grad is enabled, the training mode is the captured
   one, the arguments have the captured signature and (MoE) the aux-loss scale is unchanged and
   no routing override is set; otherwise it runs eager — with one warning for a shape change.

Constraints of replay: a captured module runs once per forward/backward pair (no re-entrant
calls, no pipelining of several forwards before their backwards); inputs are copied into static
buffers and outputs are static buffers overwritten by the next replay.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils._pytree import tree_leaves

from lightning_moe.callbacks._graphed import capture_modules
from lightning_moe.callbacks._layers import require_moe_layers
from lightning_moe.callbacks._patterns import select_modules
from lightning_moe.models.recompute import RecomputePlan
from lightning_moe.models.transformer import Attention
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.router import RouterOutput, TopKRouter

__all__ = ["CUDAGraphCapture"]

ArgSignature = tuple[tuple[tuple[int, ...], torch.dtype, torch.device, bool], ...]


def static_moe(layer: MoELayer) -> bool:
    """Whether the layer's dispatched row count is fixed (``E·capacity``) step after step."""
    return layer.config.capacity_factor is not None and layer.config.pad_to_capacity


def _signature(args: tuple[Any, ...]) -> ArgSignature | None:
    if not all(isinstance(a, torch.Tensor) for a in args):
        return None
    return tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args)


def _describe(signature: ArgSignature | None) -> str:
    if signature is None:
        return "non-tensor arguments"
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype, _, _ in signature)


class _RouterAsTuple(nn.Module):
    """A router whose output is a tuple of tensors (what the capture flattens and rebuilds)."""

    def __init__(self, router: TopKRouter) -> None:
        super().__init__()
        self.router = router

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = TopKRouter.forward(self.router, x_TH)
        return (out.logits_TE, out.topk_ids_TK, out.topk_weights_TK, out.tokens_per_expert_E, out.routed_ids_TK)


@dataclass
class _Target:
    """One module to capture, and what the warm-up learnt about its calls."""

    name: str
    module: nn.Module
    signature: ArgSignature | None = None
    order: int | None = None
    kwargs: bool = False
    training: bool = True
    original_forward: Callable[..., Any] | None = None
    had_instance_forward: bool = False
    moe_layers: list[MoELayer] = field(default_factory=list)

    def callable(self) -> nn.Module:
        if isinstance(self.module, TopKRouter):
            return _RouterAsTuple(self.module)
        return self.module

    def routers(self) -> list[TopKRouter]:
        return [m for m in self.module.modules() if isinstance(m, TopKRouter)]


class _Replay:
    """The forward of a captured module: the graph when a call matches the capture, else eager."""

    def __init__(
        self,
        owner: CUDAGraphCapture,
        target: _Target,
        graphed: Callable[..., Any],
        eager: Callable[..., Any],
    ) -> None:
        self.owner = owner
        self.target = target
        self.graphed = graphed
        self.eager = eager
        self.aux_scales = [layer.aux_loss_scale for layer in target.moe_layers]
        self.replays = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mismatch = self._mismatch(args, kwargs)
        if mismatch is not None:
            key, reason = mismatch
            if reason:
                self.owner._warn_once(key, f"CUDAGraphCapture: {self.target.name} {reason}; running it eager.")
            return self.eager(*args, **kwargs)
        out = self.graphed(*args)
        self.replays += 1
        return out

    def _mismatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str] | None:
        """``None``: replay. Else ``(warning key, reason)``; an empty reason runs eager silently."""
        t = self.target
        if not torch.is_grad_enabled() or t.module.training != t.training:
            return ("", "")  # evaluation, or a forward under no_grad
        if kwargs:
            return (f"kwargs:{t.name}", "was called with keyword arguments, which the graph does not take")
        signature = _signature(args)
        if signature != t.signature:
            return (
                "shape",
                f"was called with ({_describe(signature)}) but captured for ({_describe(t.signature)}): a shape "
                "change (this warning is shown once); calls with the captured shapes still replay. Keep batch "
                "shapes fixed (e.g. drop_last=True) to replay every step",
            )
        if [layer.aux_loss_scale for layer in t.moe_layers] != self.aux_scales:
            return ("aux", "runs with a new aux_loss_scale, which the captured backward holds as a constant")
        if any(getattr(r, "_override", None) is not None for r in t.routers()):
            return ("override", "has a routing override set (replay), which a graph cannot follow")
        return None


def _moe_buffers(modules: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: set[int] = set()
    saved = []
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, (MoELayer, TopKRouter)):
                for b in layer.buffers(recurse=False):
                    if id(b) not in seen:
                        seen.add(id(b))
                        saved.append((b, b.detach().clone()))
    return saved


def _sync_check(fn: nn.Module, sample: tuple[torch.Tensor, ...]) -> str | None:
    """Run one forward and backward with host syncs as errors; the error's first line, or None."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = [o for o in tree_leaves(fn(*sample)) if isinstance(o, torch.Tensor) and o.requires_grad]
        inputs = [a for a in sample if a.requires_grad] + [p for p in fn.parameters() if p.requires_grad]
        if outputs and inputs:
            torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs], allow_unused=True)
        return None
    except RuntimeError as err:
        return str(err).strip().splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _release_generators_from_failed_capture() -> None:
    """Give each CUDA default generator a fresh state with the same seed and offset.

    A capture that fails midway never reaches the generators' capture epilogue: they stay marked as
    capturing and every later random op on the device raises ("Offset increment outside graph
    capture"). Running eager after a failed capture needs them released.
    """
    for gen in torch.cuda.default_generators:
        try:
            fresh = torch.Generator(device=gen.device)
            fresh.set_state(gen.get_state())
            gen.graphsafe_set_state(fresh.graphsafe_get_state())
        except RuntimeError as err:  # pragma: no cover - depends on the torch build
            warnings.warn(f"CUDAGraphCapture: could not reset the CUDA generator after a failed capture ({err}).")


class CUDAGraphCapture(Callback):
    """Capture static-shape regions after warm-up and replay them as CUDA graphs.

    Args:
        modules: fnmatch patterns on qualified module names (outermost matches), e.g.
            ``["*.attn", "*.ffn"]``; ``None`` is auto: attention, static MoE layers whole, and the
            routers of dynamic MoE layers.
        warmup_steps: training steps (micro-batches) run eager before the capture (>= 1).

    Example::

        moe = MoEConfig(..., capacity_factor=1.25, pad_to_capacity=True)  # static shapes
        trainer = L.Trainer(precision="bf16-true", callbacks=[CUDAGraphCapture(warmup_steps=3)])

    Plain loops: ``attach(model, device)`` once, ``step()`` before every training step,
    ``detach()`` at the end.
    """

    supports_pipeline_parallel = False  # acts on one forward and backward of the whole model

    def __init__(self, modules: list[str] | None = None, warmup_steps: int = 3) -> None:
        super().__init__()
        if isinstance(modules, str):
            raise ValueError(f"CUDAGraphCapture: modules={modules!r} must be a list; write modules=[{modules!r}].")
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"CUDAGraphCapture: warmup_steps={warmup_steps!r} must be an int >= 1 (the warm-up records the "
                "shapes to capture); use e.g. warmup_steps=3."
            )
        self.modules = None if modules is None else list(modules)
        self.warmup_steps = warmup_steps
        self.targets: list[_Target] = []
        self.captured: list[_Target] = []
        self._steps = 0
        self._active = False
        self._hooks: list[Any] = []
        self._warned: set[str] = set()
        self.last_captured: list[str] = []  # names captured in the last run (kept after detach)
        self.replays = 0  # graph replays in the last run

    # --- plain-loop API ------------------------------------------------------------------------

    def attach(self, module: nn.Module, device: torch.device | str, precision: str = "32-true") -> None:
        """Resolve and check the modules; on CUDA start recording their calls."""
        require_moe_layers("CUDAGraphCapture", module)
        self.targets = [_Target(name, m) for name, m in self._resolve(module)]
        self._check(module)
        if "mixed" in str(precision):
            raise ValueError(
                f"CUDAGraphCapture: precision={precision!r} runs the model under torch.autocast, which a captured "
                "graph would not follow; use precision='bf16-true' (bf16 parameters) with graph capture."
            )
        if torch.device(device).type != "cuda":
            rank_zero_info(
                f"CUDAGraphCapture: the root device is {torch.device(device).type}, not CUDA: there is nothing "
                "to capture, so the callback is a no-op."
            )
            return
        self._active = True
        for target in self.targets:
            target.moe_layers = [m for m in target.module.modules() if isinstance(m, MoELayer)]
            self._hooks.append(target.module.register_forward_pre_hook(partial(self._record, target), with_kwargs=True))

    def step(self) -> None:
        """Call before each training step: capture once the warm-up steps have run."""
        if not self._active:
            return
        self._steps += 1
        if self._steps == self.warmup_steps + 1:
            self.capture()

    def capture(self) -> None:
        """Capture every recorded module that can be captured (see the module docstring, stage 3)."""
        self._remove_hooks()
        ready = []
        recorded = sorted((t for t in self.targets if t.order is not None), key=lambda t: t.order or 0)
        for target in recorded:
            reason = self._cannot_capture(target)
            if reason is not None:
                self._warn_once(f"skip:{target.name}", f"CUDAGraphCapture: {target.name} stays eager: {reason}.")
            else:
                ready.append(target)
        if not ready:
            return
        callables = [t.callable() for t in ready]
        for target, fn in zip(ready, callables):
            fn.train(target.training)
        samples = [self._sample(t.signature) for t in ready]  # type: ignore[arg-type]
        saved = _moe_buffers(callables)
        try:
            checked = [(t, fn, s, _sync_check(fn, s)) for t, fn, s in zip(ready, callables, samples)]
            for t, _, _, err in checked:
                if err is not None:
                    self._warn_once(
                        f"sync:{t.name}",
                        f"CUDAGraphCapture: {t.name} synchronizes with the host ({err}); it stays eager.",
                    )
            kept = [(t, fn, s) for t, fn, s, err in checked if err is None]
            if not kept:
                return
            for t, _, _ in kept:
                t.had_instance_forward = "forward" in vars(t.module)
                t.original_forward = t.module.forward
            graphed = capture_modules([fn for _, fn, _ in kept], [s for _, _, s in kept])
        except Exception as err:  # a capture that fails leaves every module eager
            _release_generators_from_failed_capture()
            self._warn_once(
                "capture", f"CUDAGraphCapture: capture failed ({type(err).__name__}: {err}); running eager."
            )
            return
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)  # in place: the graphs hold these addresses
        for (target, _, _), graphed_fn in zip(kept, graphed):
            self._install(target, graphed_fn)

    def detach(self) -> None:
        """Stop recording and restore the eager forwards."""
        self._remove_hooks()
        if self.captured:
            self.last_captured = [t.name for t in self.captured]
            self.replays = sum(getattr(t.module.forward, "replays", 0) for t in self.captured)
        for target in self.captured:
            if target.had_instance_forward:
                target.module.forward = target.original_forward  # type: ignore[method-assign]
            elif "forward" in vars(target.module):
                del target.module.forward
        self.captured.clear()
        self._active = False

    # --- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.attach(pl_module, trainer.strategy.root_device, str(trainer.precision))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.step()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.detach()

    # --- internals -----------------------------------------------------------------------------

    def _resolve(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        if self.modules is not None:
            return select_modules("CUDAGraphCapture", root, self.modules, "modules")
        picked: list[tuple[str, nn.Module]] = []
        for name, m in root.named_modules():
            if any(name.startswith(p + ".") for p, _ in picked):
                continue
            if isinstance(m, Attention) or (isinstance(m, MoELayer) and static_moe(m)):
                picked.append((name, m))
            elif isinstance(m, TopKRouter):
                picked.append((name, m))
        return picked

    def _check(self, root: nn.Module) -> None:
        named = dict(root.named_modules())
        for target in self.targets:
            parts = target.name.split(".")
            ancestors = [named[".".join(parts[:i])] for i in range(len(parts))]  # "" is the root
            inside = ancestors + list(target.module.modules())
            for layer in (m for m in inside if isinstance(m, MoELayer)):
                router_only = isinstance(target.module, TopKRouter) or any(isinstance(a, TopKRouter) for a in ancestors)
                if not static_moe(layer) and not router_only:
                    cfg = layer.config
                    raise ValueError(
                        f"CUDAGraphCapture: modules={self.modules} selects {target.name}, which runs the dynamic-shape "
                        f"dispatch of MoE layer {layer.layer_name} (capacity_factor={cfg.capacity_factor}, "
                        f"pad_to_capacity={cfg.pad_to_capacity}: its row count changes every step) and cannot be "
                        "replayed; set MoEConfig(capacity_factor=1.25, pad_to_capacity=True), or capture only "
                        "attention and routers (modules=['*.attn', '*.router'], or modules=None)."
                    )
            for block in (a for a in ancestors if isinstance(getattr(a, "recompute", None), RecomputePlan)):
                plan: RecomputePlan = block.recompute  # type: ignore[assignment]
                rerun = plan.block or (plan.attn and _within(target.module, block, "attn"))
                rerun = rerun or (plan.moe and _within(target.module, block, "ffn"))
                if rerun:
                    raise ValueError(
                        f"CUDAGraphCapture: {target.name} is re-run in backward by TransformerConfig.recompute="
                        f"{plan.targets()}, and a captured module must run once per step; drop it from recompute "
                        "or from modules."
                    )

    def _record(self, target: _Target, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        if target.order is None:
            target.order = sum(t.order is not None for t in self.targets)
        target.kwargs = bool(kwargs)
        target.signature = _signature(args)
        target.training = module.training

    def _cannot_capture(self, target: _Target) -> str | None:
        if target.kwargs:
            return "it is called with keyword arguments"
        if target.signature is None:
            return "it takes non-tensor arguments"
        if any(getattr(r, "_override", None) is not None for r in target.routers()):
            return "a routing override (replay) is set on its router"
        m = target.module
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return "another callback registered hooks on it (a graph would run them once, at capture, and never again)"
        return None

    @staticmethod
    def _sample(signature: ArgSignature) -> tuple[torch.Tensor, ...]:
        out = []
        for shape, dtype, device, requires_grad in signature:
            if dtype.is_floating_point:
                out.append(torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad))
            else:
                out.append(torch.zeros(shape, dtype=dtype, device=device))
        return tuple(out)

    def _install(self, target: _Target, graphed_forward: Callable[..., Any]) -> None:
        eager = target.original_forward
        assert eager is not None
        if isinstance(target.module, TopKRouter):

            def graphed(x_TH: torch.Tensor) -> RouterOutput:
                return RouterOutput(*graphed_forward(x_TH))

        else:
            graphed = graphed_forward
        target.module.forward = _Replay(self, target, graphed, eager)  # type: ignore[method-assign]
        self.captured.append(target)

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _warn_once(self, key: str, message: str) -> None:
        """One warning per key: per module for skips, per callback for shape changes."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def _within(module: nn.Module, block: nn.Module, child: str) -> bool:
    sub = getattr(block, child, None)
    return isinstance(sub, nn.Module) and any(m is module for m in sub.modules())
