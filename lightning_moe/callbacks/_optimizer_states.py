"""Optimizer states in host memory between steps, streamed in chunks (used by ``CPUOffload``).

Also the host allocator both halves of ``CPUOffload`` share: pinned buffers, falling back to
pageable memory with one warning when pinning fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

__all__ = ["OptimizerStateOffloader", "PinnedAllocator", "resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so that comparisons with ``tensor.device`` hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class PinnedAllocator:
    """Host buffers: pinned, or pageable after the first pinned allocation fails (one warning)."""

    def __init__(self, owner: str, pin: bool) -> None:
        self.owner = owner
        self.pin = pin

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError as err:
                self.pin = False
                size = numel * torch.empty((), dtype=dtype).element_size() / 2**20
                warnings.warn(
                    f"{self.owner}: pinned host memory allocation of {size:.1f} MiB failed ({err}); falling back to "
                    "pageable host memory: copies become synchronous and slower, results are unchanged.",
                    stacklevel=3,
                )
        return torch.empty(numel, dtype=dtype)


class OptimizerStateOffloader:
    """Keep ``optimizer``'s state tensors on the host between steps; step chunk by chunk.

    Replaces ``optimizer.step`` (an instance attribute; :meth:`detach` restores it). A closure is
    run first, as ``torch.optim`` does; then, for each chunk of parameters that have gradients,
    only that chunk is left in the param groups and the original ``step`` runs. Per-parameter
    optimizers (SGD, Adam, AdamW, ...) give the same numbers as one ``step`` over all parameters.
    Optimizer step hooks run once per chunk. State tensors under ``min_tensor_bytes`` (step
    counters) stay where they are.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        chunk_bytes: int = 512 << 20,
        min_tensor_bytes: int = 1 << 12,
        pin_memory: bool | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.device = resolve_device(device)
        self.chunk_bytes = chunk_bytes
        self.min_tensor_bytes = min_tensor_bytes
        self._cuda = self.device.type == "cuda"
        self._host = PinnedAllocator("CPUOffload", self._cuda if pin_memory is None else pin_memory)
        self._d2h = torch.cuda.Stream(self.device) if self._cuda else None
        self._h2d = torch.cuda.Stream(self.device) if self._cuda else None
        self._ours: dict[int, torch.Tensor] = {}  # the host tensors this offloader put into the state
        self._d2h_done: dict[int, Any] = {}  # id(param) -> event after its states went out
        self._h2d_done: dict[int, Any] = {}  # id(param) -> event after its states came in
        self._original: Callable[..., Any] | None = None
        self._original_state_dict: Callable[[], dict[str, Any]] = optimizer.state_dict
        self._had_instance: dict[str, bool] = {}

    def attach(self) -> None:
        if self._original is not None:
            return
        self._had_instance = {name: name in vars(self.optimizer) for name in ("step", "state_dict")}
        self._original = self.optimizer.step

        def step(closure: Callable[[], Any] | None = None) -> Any:
            return self.step(closure)

        # An LR scheduler created later re-binds a bound ``step`` to the optimizer; a plain
        # function marked as already wrapped is left alone (this ``step`` flags the call itself).
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.optimizer.step = step  # type: ignore[method-assign]
        # Readers of the state (checkpointing) must not see a host copy still being written.
        self._original_state_dict = self.optimizer.state_dict
        self.optimizer.state_dict = self._synchronized_state_dict  # type: ignore[method-assign]

    def _synchronized_state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return self._original_state_dict()

    def detach(self) -> None:
        """Restore ``step`` and move every state tensor back to the device."""
        if self._original is None:
            return
        self.synchronize()
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and id(value) in self._ours:
                    state[key] = value.to(self.device)
        self._ours.clear()
        if self._had_instance["step"]:
            self.optimizer.step = self._original  # type: ignore[method-assign]
        else:
            del self.optimizer.step
        if self._had_instance["state_dict"]:
            self.optimizer.state_dict = self._original_state_dict  # type: ignore[method-assign]
        else:
            del self.optimizer.state_dict
        self._original = None

    def synchronize(self) -> None:
        """Wait until the host copies are complete (before reading the state, e.g. to save it)."""
        if self._d2h is not None:
            self._d2h.synchronize()

    def state_bytes_on_device(self) -> int:
        """Bytes of the state tensors this offloader moves that are on the device right now."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if self._movable(value):
                    total += value.numel() * value.element_size()
        return total

    def _movable(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.device == self.device
            and id(value) not in self._ours
            and value.numel() * value.element_size() >= self.min_tensor_bytes
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._original is None:
            raise RuntimeError(
                "OptimizerStateOffloader.step was called before attach(); attach the offloader to the optimizer "
                "first (the CPUOffload callback does it when fit starts, through wrap_optimizers)."
            )
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check
        chunks = self._chunks()
        groups = self.optimizer.param_groups
        full = [group["params"] for group in groups]
        try:
            if chunks:
                self._fetch(chunks[0], prefetch=False)
            for i, chunk in enumerate(chunks):
                if i + 1 < len(chunks):
                    self._fetch(chunks[i + 1], prefetch=True)
                self._wait(chunk)
                ids = {id(p) for p in chunk}
                for group, params in zip(groups, full):
                    group["params"] = [p for p in params if id(p) in ids]
                self._original()
                self._store(chunk)
        finally:
            for group, params in zip(groups, full):
                group["params"] = params
        return loss

    def _chunks(self) -> list[list[torch.Tensor]]:
        chunks: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= self.chunk_bytes:
                    chunks.append(current)
                    current, size = [], 0
        if current:
            chunks.append(current)
        return chunks

    def _fetch(self, chunk: list[torch.Tensor], prefetch: bool) -> None:
        current = torch.cuda.current_stream(self.device) if self._cuda else None
        stream = self._h2d if prefetch else current
        moves: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        for p in chunk:
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and id(value) in self._ours:
                    moves.append((state, key, value, torch.empty_like(value, device=self.device)))
            event = self._d2h_done.get(id(p))
            if event is not None and stream is not None:
                stream.wait_event(event)  # its previous D2H has finished writing the host copy
        if not moves:
            return
        if stream is not None and stream is not current:
            stream.wait_stream(current)  # reused device blocks may still be read by queued work
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for state, key, host, value in moves:
                value.copy_(host, non_blocking=True)
                state[key] = value
                self._ours.pop(id(host), None)
        if self._cuda:
            event = torch.cuda.Event()
            event.record(stream)
            for p in chunk:
                self._h2d_done[id(p)] = event

    def _wait(self, chunk: list[torch.Tensor]) -> None:
        if not self._cuda:
            return
        current = torch.cuda.current_stream(self.device)
        events: list[Any] = []
        for p in chunk:
            event = self._h2d_done.pop(id(p), None)
            if event is not None and all(event is not seen for seen in events):
                events.append(event)
        for event in events:
            current.wait_event(event)

    def _store(self, chunk: list[torch.Tensor]) -> None:
        moves: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for p in chunk:
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if self._movable(value):
                    moves.append((state, key, value))
        if not moves:
            return
        if self._cuda:
            assert self._d2h is not None
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))  # the step wrote them
        with torch.cuda.stream(self._d2h) if self._cuda else nullcontext():
            for state, key, value in moves:
                host = self._host.empty(value.numel(), value.dtype).view(value.shape)
                host.copy_(value, non_blocking=self._cuda)
                if self._cuda:
                    value.record_stream(self._d2h)  # type: ignore[arg-type]
                state[key] = host
                self._ours[id(host)] = host
        if self._cuda:
            event = torch.cuda.Event()
            event.record(self._d2h)
            for p in chunk:
                self._d2h_done[id(p)] = event
