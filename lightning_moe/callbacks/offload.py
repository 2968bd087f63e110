"""CPUOffload: saved activations to pinned host memory, optimizer states kept on the host.

Two independent halves, each a small engine usable from a plain training loop too:

:class:`ActivationOffloader` — ``activations=[patterns]`` selects modules (outermost matches of
fnmatch patterns on qualified names). Stages per step:

1. forward, while a selected module runs: a ``saved_tensors_hooks`` pair copies every tensor
   autograd saves (one copy per storage; parameters, their dtype casts, tensors under
   ``min_tensor_bytes`` and small views of large buffers stay) to pinned host memory on a
   side stream (D2H), and marks the device block reusable once the copy ran (``record_stream``).
   The module's group of tensors is one unit. The last group of the previous step stays on the
   device: backward needs it first.
2. backward, first time a group's tensor is needed: the group comes back (H2D) — already in
   flight if it was prefetched — and the ``prefetch`` offloaded groups before it in forward order
   are brought back on a second side stream. A copy issued there starts once the compute queued
   before the current group's backward is done (its destination may be a block that compute
   freed), so it hides behind the backward of the groups in between: one group ahead is not
   enough when a small module (a norm) precedes a large one (attention). The default, 2: on the
   H200 (4-layer Qwen3-30B-A3B-shaped model, every block child offloaded) 2 and 4 cost the same
   step time (+10 %), and 2 holds less in backward (peak -70 % vs -63 %).

Copies are exact, so losses and gradients are bitwise those without offload. Saved tensors that
an enclosing hook pair wants (the block's recompute scope, a checkpoint) go to it first.

Routed experts inside a selected module (``rebuild_experts``, default on) keep only their input
and first projection: the gathered rows ``x_RH`` and the activation ``a_RF`` are rebuilt in
backward (``GroupedExperts.lean_backward``; the same gather and SwiGLU, so bitwise equal). The
re-gather reads and writes device memory at ~4 TB/s; copying the same bytes out and back over the
host link (~50 GB/s each way) costs about 100x more time, and on fine-grained MoE those two
buffers are over half of what the layer saves.

:class:`OptimizerStateOffloader` — ``optimizer_states=True``: between steps every state tensor
of the optimizer (AdamW's ``exp_avg``/``exp_avg_sq``: 2x the parameter bytes) lives in pinned host
memory. ``optimizer.step`` runs chunk by chunk (``chunk_bytes`` of parameters): the states of
chunk i+1 come in while chunk i steps on the device with the user's own optimizer and kernels,
then go back out. Device memory holds at most two chunks of states.

On a machine without CUDA the callback checks its arguments, logs one info line and does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_moe.callbacks._layers import require_moe_layers
from lightning_moe.callbacks._optimizer_states import OptimizerStateOffloader, PinnedAllocator, resolve_device
from lightning_moe.callbacks._patterns import select_modules
from lightning_moe.moe.experts import GroupedExperts

__all__ = ["ActivationOffloader", "CPUOffload", "OptimizerStateOffloader"]

DEFAULT_ACTIVATIONS = ("*layers.*.*",)  # every direct child of every block: norms, attention, FFN


def check_prefetch(owner: str, prefetch: int) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(
            f"{owner}: prefetch={prefetch!r} must be an int >= 0: how many offloaded modules come back ahead "
            "of the one running backward (0 turns prefetching off)."
        )
    return prefetch


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _top_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


# ----------------------------------------------------------------------------------------------
# activations


class _Stored:
    """One device storage, copied to the host (or kept, for the group backward needs first)."""

    __slots__ = ("dtype", "host", "numel", "ref", "uses", "value")

    def __init__(self, numel: int, dtype: torch.dtype, ref: StorageWeakRef) -> None:
        self.numel = numel
        self.dtype = dtype
        self.ref = ref
        self.host: torch.Tensor | None = None
        self.value: torch.Tensor | None = None  # the flat device tensor while it is on the device
        self.uses = 0  # tokens packed and not yet unpacked


class _Group:
    """The saved tensors of one forward call of one selected module."""

    def __init__(self, name: str, index: int, siblings: list[weakref.ref[_Group]], keep: bool) -> None:
        self.name = name
        self.index = index
        self.siblings = siblings  # the groups of the same step, in forward order
        self.keep = keep
        self.stored: list[_Stored] = []
        self.by_ptr: dict[int, _Stored] = {}
        self.d2h_done: Any = None
        self.h2d_done: Any = None
        self.loaded = keep
        self.in_use = False


@dataclass
class _Packed:
    group: _Group
    stored: _Stored
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Delegated:
    unpack: Callable[[Any], torch.Tensor]
    payload: Any


class ActivationOffloader:
    """Offload the saved activations of ``modules`` (see the module docstring for the stages).

    Args:
        modules: ``(name, module)`` pairs; each forward call of one is a group.
        device: the accelerator the activations live on (``cpu`` exercises the logic, copying
            host to host, for tests).
        prefetch: how many offloaded groups, in backward order, are brought back ahead of the one
            running backward (0: each group comes back when backward first needs it).
        min_tensor_bytes: smaller saved tensors stay on the device.
        pin_memory: pinned host buffers (default: on CUDA).
        max_bytes_per_step: offload at most this many bytes per step, in forward order; later
            tensors stay on the device (``None``: no limit). Device-to-host copies only hide behind
            the forward if they fit its duration at the link's bandwidth (H200 over PCIe 5:
            ~50 GB/s), so a budget trades memory saved for step time.
        rebuild_experts: routed experts inside the modules rebuild their gathered rows and
            activation in backward instead of saving them (see the module docstring).
    """

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        device: torch.device,
        prefetch: int = 2,
        min_tensor_bytes: int = 1 << 20,
        pin_memory: bool | None = None,
        max_bytes_per_step: int | None = None,
        rebuild_experts: bool = True,
    ) -> None:
        self.modules = list(modules)
        self.rebuild_experts = rebuild_experts
        self._lean_before: list[tuple[nn.Module, Any]] = []
        self.max_bytes_per_step = max_bytes_per_step
        self.device = resolve_device(device)
        self.prefetch = check_prefetch("ActivationOffloader", prefetch)
        self.min_tensor_bytes = min_tensor_bytes
        self._cuda = self.device.type == "cuda"
        self._host = PinnedAllocator("CPUOffload", self._cuda if pin_memory is None else pin_memory)
        self._d2h = torch.cuda.Stream(self.device) if self._cuda else None
        self._h2d = torch.cuda.Stream(self.device) if self._cuda else None
        self._handles: list[Any] = []
        self._stack: list[tuple[_Group, Any] | None] = []
        self._groups: list[weakref.ref[_Group]] = []
        self._backward_seen = False
        self._last_count = 0
        self.offloaded_bytes = 0  # host bytes written during the current step

    def attach(self) -> None:
        for name, module in self.modules:
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
            if self.rebuild_experts:
                for sub in module.modules():
                    if isinstance(sub, GroupedExperts):
                        self._lean_before.append((sub, sub.lean_backward))
                        sub.lean_backward = True

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for experts, lean in reversed(self._lean_before):
            experts.lean_backward = lean
        self._lean_before.clear()

    # --- forward -------------------------------------------------------------------------------

    def _enter(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or _in_backward():  # eval, or a checkpoint recomputing
            self._stack.append(None)
            return
        if self._backward_seen:  # a new step
            self._last_count, self._groups = len(self._groups), []
            self._backward_seen = False
            self.offloaded_bytes = 0
        index = len(self._groups)
        group = _Group(name, index, self._groups, keep=index == self._last_count - 1)
        self._groups.append(weakref.ref(group))
        self._stack.append((group, _top_hooks()))
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        entry = self._stack.pop()
        if entry is None:
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()
        group = entry[0]
        if self._cuda and group.stored and not group.keep:
            group.d2h_done = torch.cuda.Event()
            group.d2h_done.record(self._d2h)

    def _offloadable(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type != self.device.type:
            return False
        if t.requires_grad and t.is_leaf:  # a parameter (or a user leaf): not an activation
            return False
        nbytes = t.numel() * t.element_size()
        storage_bytes = t.untyped_storage().nbytes()
        if nbytes < self.min_tensor_bytes or 2 * nbytes < storage_bytes or storage_bytes % t.element_size():
            return False
        node = t.grad_fn  # a dtype cast of a parameter (autocast's weight copy) is a weight too
        return not (
            node is not None
            and node.name() == "ToCopyBackward0"
            and type(node.next_functions[0][0]).__name__ == "AccumulateGrad"
        )

    def _pack(self, t: torch.Tensor) -> Any:
        top = self._stack[-1] if self._stack else None
        if top is None:
            return t
        group, outer = top
        if outer is not None:  # an enclosing recompute scope or checkpoint has first claim
            claimed = outer[0](t)
            if claimed is not t:
                return _Delegated(outer[1], claimed)
        if not self._offloadable(t):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        stored = group.by_ptr.get(ptr)
        if stored is None or stored.ref.expired() or stored.dtype != t.dtype:
            stored = self._copy_out(t, group.keep or self._over_budget(storage.nbytes()))
            group.by_ptr[ptr] = stored
            group.stored.append(stored)
        stored.uses += 1
        return _Packed(group, stored, t.size(), t.stride(), t.storage_offset())

    def _over_budget(self, nbytes: int) -> bool:
        limit = self.max_bytes_per_step
        return limit is not None and self.offloaded_bytes + nbytes > limit

    def _copy_out(self, t: torch.Tensor, keep: bool) -> _Stored:
        numel = t.untyped_storage().nbytes() // t.element_size()
        flat = t.as_strided((numel,), (1,), 0)  # the whole storage, whatever view t is
        stored = _Stored(numel, t.dtype, StorageWeakRef(t.untyped_storage()))
        if keep:
            stored.value = flat
            return stored
        host = self._host.empty(numel, t.dtype)
        if self._cuda:
            assert self._d2h is not None
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # t is ready
            with torch.cuda.stream(self._d2h):
                host.copy_(flat, non_blocking=True)
            flat.record_stream(self._d2h)  # the block is not reused before the copy ran
        else:
            host.copy_(flat)
        stored.host = host
        self.offloaded_bytes += host.numel() * host.element_size()
        return stored

    # --- backward ------------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Delegated):
            return packed.unpack(packed.payload)
        if not isinstance(packed, _Packed):
            return packed
        self._backward_seen = True
        group, stored = packed.group, packed.stored
        if not group.in_use:
            group.in_use = True
            self._bring_back(group, prefetch=False)
            for earlier in self._earlier_offloaded(group, self.prefetch):
                if not earlier.loaded:
                    self._bring_back(earlier, prefetch=True)
        if stored.value is None:  # a second backward over a retained graph
            self._bring_back_one(stored, torch.cuda.current_stream(self.device) if self._cuda else None)
        out = stored.value.as_strided(packed.size, packed.stride, packed.offset)  # type: ignore[union-attr]
        stored.uses -= 1
        if stored.uses <= 0 and stored.host is not None:
            stored.value = None  # autograd owns it now; freed when its consumer is done
        return out

    def _earlier_offloaded(self, group: _Group, count: int) -> list[_Group]:
        """Up to ``count`` groups before ``group`` in forward order that have tensors on the host."""
        found: list[_Group] = []
        for i in range(group.index - 1, -1, -1):
            if len(found) >= count:
                break
            earlier = group.siblings[i]()
            if earlier is not None and any(s.host is not None for s in earlier.stored):
                found.append(earlier)
        return found

    def _bring_back_one(self, stored: _Stored, stream: Any) -> None:
        assert stored.host is not None
        value = torch.empty(stored.numel, dtype=stored.dtype, device=self.device)
        if stream is None:
            value.copy_(stored.host)
        else:
            with torch.cuda.stream(stream):
                value.copy_(stored.host, non_blocking=True)
        stored.value = value

    def _bring_back(self, group: _Group, prefetch: bool) -> None:
        if not self._cuda:
            if not group.loaded:
                for stored in group.stored:
                    if stored.uses > 0 and stored.value is None:  # kept ones never left
                        self._bring_back_one(stored, None)
                group.loaded = True
            return
        current = torch.cuda.current_stream(self.device)
        if not group.loaded:
            stream = self._h2d if prefetch else current
            todo = [s for s in group.stored if s.uses > 0 and s.value is None]
            # Allocated on the compute stream; the copy stream first waits for the work queued there
            # (a reused block may still be read by it) and for the D2H copies of this group.
            values = [torch.empty(s.numel, dtype=s.dtype, device=self.device) for s in todo]
            if group.d2h_done is not None:
                stream.wait_event(group.d2h_done)
            if stream is not current:
                stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for stored, value in zip(todo, values):
                    value.copy_(stored.host, non_blocking=True)
                    stored.value = value
            group.h2d_done = torch.cuda.Event()
            group.h2d_done.record(stream)
            group.loaded = True
        if not prefetch and group.h2d_done is not None:
            current.wait_event(group.h2d_done)


# ----------------------------------------------------------------------------------------------
# the callback


class CPUOffload(Callback):
    """Offload saved activations of chosen modules, and optionally optimizer states, to the host.

    Args:
        activations: fnmatch patterns on qualified module names (``named_modules()``); the
            outermost matches are offloaded, one group per forward call. ``None`` is
            ``["*layers.*.*"]``: every child (norms, attention, FFN) of every block. ``[]`` offloads
            no activations. A pattern that matches nothing raises, listing the names there are.
        optimizer_states: keep optimizer state tensors in host memory between steps.
        prefetch: how many offloaded modules, in backward order, come back ahead of the one running
            backward (0: each when first needed).
        min_tensor_bytes: saved tensors smaller than this stay on the device.
        max_offload_gib: offload at most this much activation memory per step, the earliest
            modules first (``None``: everything selected). Copies hide behind the forward only up
            to its duration times the host link's bandwidth; past that they add to the step time.
        rebuild_experts: routed experts inside the offloaded modules rebuild their gathered rows
            and activation in backward instead of saving (and copying) them.

    Example::

        trainer = L.Trainer(callbacks=[CPUOffload(activations=["*layers.*.ffn"], optimizer_states=True)])

    Plain loops: ``CPUOffload(...).attach(model, device, optimizers=[opt])`` and ``detach()``.
    """

    supports_pipeline_parallel = False  # acts on one forward and backward of the whole model

    def __init__(
        self,
        activations: list[str] | None = None,
        optimizer_states: bool = False,
        prefetch: int = 2,
        min_tensor_bytes: int = 1 << 20,
        max_offload_gib: float | None = None,
        rebuild_experts: bool = True,
    ) -> None:
        super().__init__()
        self.rebuild_experts = rebuild_experts
        if isinstance(activations, str):
            raise ValueError(
                f"CPUOffload: activations={activations!r} must be a list; write activations=[{activations!r}]."
            )
        if min_tensor_bytes < 0:
            raise ValueError(f"CPUOffload: min_tensor_bytes={min_tensor_bytes} must be >= 0.")
        if max_offload_gib is not None and not max_offload_gib > 0:
            raise ValueError(
                f"CPUOffload: max_offload_gib={max_offload_gib} must be > 0 (or None for no limit); "
                "use activations=[] to offload no activations."
            )
        self.max_offload_gib = max_offload_gib
        self.activations = list(DEFAULT_ACTIVATIONS if activations is None else activations)
        self.optimizer_states = optimizer_states
        self.prefetch = check_prefetch("CPUOffload", prefetch)
        self.min_tensor_bytes = min_tensor_bytes
        self.activation_offloader: ActivationOffloader | None = None
        self.optimizer_offloaders: list[OptimizerStateOffloader] = []
        self._device: torch.device | None = None

    # --- plain-loop API ------------------------------------------------------------------------

    def attach(
        self, module: nn.Module, device: torch.device | str, optimizers: Sequence[torch.optim.Optimizer] = ()
    ) -> None:
        """Check the patterns against ``module``; on CUDA hook the modules and wrap the optimizers."""
        require_moe_layers("CPUOffload", module)
        selected = select_modules("CPUOffload", module, self.activations, "activations") if self.activations else []
        device = resolve_device(device)
        if device.type != "cuda":
            rank_zero_info(
                f"CPUOffload: the root device is {device.type}, not CUDA: there is no device memory to free, "
                "so the callback is a no-op."
            )
            return
        self._device = device
        if selected and self.activation_offloader is None:
            budget = None if self.max_offload_gib is None else int(self.max_offload_gib * 2**30)
            self.activation_offloader = ActivationOffloader(
                selected, device, self.prefetch, self.min_tensor_bytes, max_bytes_per_step=budget,
                rebuild_experts=self.rebuild_experts,
            )
            self.activation_offloader.attach()
        self.wrap_optimizers(optimizers)

    def wrap_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not self.optimizer_states or self._device is None:
            return
        wrapped = {id(o.optimizer) for o in self.optimizer_offloaders}
        for optimizer in optimizers:
            if id(optimizer) not in wrapped:
                offloader = OptimizerStateOffloader(optimizer, self._device)
                offloader.attach()
                self.optimizer_offloaders.append(offloader)

    def detach(self) -> None:
        if self.activation_offloader is not None:
            self.activation_offloader.detach()
            self.activation_offloader = None
        for offloader in self.optimizer_offloaders:
            offloader.detach()
        self.optimizer_offloaders.clear()

    # --- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.attach(pl_module, trainer.strategy.root_device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wrap_optimizers(trainer.optimizers)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.detach()
