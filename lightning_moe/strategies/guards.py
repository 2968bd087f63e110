"""Guards of the folded strategies: the rank-liveness watchdog and the non-finite guard.

Liveness (``parallel/liveness.py``): :func:`start_liveness_watchdog` starts one watchdog per
process (unless off or alone); :func:`note_dead_rank` adds its verdict, the line naming a dead
rank, to a collective's exception. Where Lightning's launcher started the ranks, its
child-process observer (``launcher.py``) waits for that verdict and the watchdog's own exit before
killing the processes, so a rank the watchdog finds dead is named before that kill.

Non-finite guard (``parallel/finite.py``): the strategy owns ``guard_nonfinite`` and
``skip_nonfinite``. :func:`nonfinite_guard_for` builds the guard from them (a module's deprecated
options forwarded); :func:`guarded_closure` runs it after an optimizer closure's backward, before
clipping and the step. :class:`FabricStepGuard` does the same on Fabric's optimizer-step path,
where the loss comes from ``fabric.backward`` and the step may have no closure.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_moe.parallel.finite import NonFiniteGuard, forward_nonfinite_options, guard_closure, world_group
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.liveness import ensure_watchdog, is_collective_failure, running_watchdog

__all__ = [
    "FabricStepGuard",
    "gradients_checked_by_guard",
    "guarded_closure",
    "nonfinite_guard_for",
    "note_dead_rank",
    "start_liveness_watchdog",
]


def start_liveness_watchdog(owner: str, layout: FoldedLayout, rank: int, timeout_s: float | None) -> None:
    """The rank-liveness watchdog (one per process), unless ``timeout_s`` is ``None`` or the world is one rank."""
    if timeout_s is None or layout.world_size < 2:
        return

    def describe(r: int) -> str:
        return " ".join(f"{a}={c}" for a, c in layout.coords(r).items() if layout.size(a) > 1)

    ensure_watchdog(rank, layout.world_size, timeout_s, owner=owner, describe=describe)


def note_dead_rank(exception: BaseException) -> None:
    """A collective that failed because a peer died gets the watchdog's line naming it as a note."""
    watchdog = running_watchdog()
    if watchdog is not None and is_collective_failure(exception):
        verdict = watchdog.wait_verdict(watchdog.monitor.threshold_s + 2.0)
        if verdict is not None:
            exception.add_note(verdict)


def nonfinite_guard_for(owner: str, options: tuple[bool, int], module: nn.Module | None) -> NonFiniteGuard | None:
    """The guard for ``owner``'s ``(guard_nonfinite, skip_nonfinite)``, with the options ``module``
    (a ``MoELanguageModelBase``) forwards from its deprecated arguments; ``None`` when off."""
    forwarded = getattr(module, "forwarded_nonfinite_options", None) or {}
    guard, skip = forward_nonfinite_options(owner, options, type(module).__name__, forwarded)
    return NonFiniteGuard(owner, skip) if guard else None


def gradients_checked_by_guard(precision: Any) -> bool:
    """False under fp16 loss scaling: an enabled ``GradScaler`` judges the gradients itself."""
    scaler = getattr(precision, "scaler", None)
    return scaler is None or not scaler.is_enabled()


def guarded_closure(
    guard: NonFiniteGuard, closure: Callable[[], Any], module: nn.Module, device: torch.device, step: int, precision: Any
) -> Callable[[], Any]:
    """``closure`` followed by the guard over the world (``guard_closure``); skipped steps are warned."""
    return guard_closure(
        guard, closure, module, world_group(), device, step,
        check_gradients=gradients_checked_by_guard(precision), on_skip=rank_zero_warn,
    )  # fmt: skip


class FabricStepGuard:
    """The non-finite guard on Fabric's step path (``Strategy.optimizer_step``).

    The strategy tells it the modules it set up (:meth:`watch`) and the losses of
    ``fabric.backward`` (:meth:`record_loss`); :meth:`before_step` checks the step's losses (a sum:
    non-finite if any is) and the gradients of the module that holds the optimizer's parameters,
    then raises, or drops the gradients of a skipped step, before the optimizer reads them. With a
    closure (``optimizer.step(closure)``) the check runs after the closure, on its loss.
    """

    def __init__(self, guard: NonFiniteGuard) -> None:
        self.guard = guard
        self.step = 0  # optimizer steps taken through this guard, as the Trainer's global_step
        self._modules: list[weakref.ref[nn.Module]] = []
        self._losses: list[torch.Tensor] = []

    def watch(self, module: nn.Module) -> None:
        self._modules = [ref for ref in self._modules if ref() is not None] + [weakref.ref(module)]

    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def module_of(self, optimizer: Any) -> nn.Module:
        """The set-up module holding ``optimizer``'s parameters; ``ValueError`` when there is none."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ref in self._modules:
            module = ref()
            if module is not None and any(id(p) in ids for p in module.parameters()):
                return module
        raise ValueError(
            f"{self.guard.owner}: guard_nonfinite=True checks the gradients of a module set up with fabric.setup, "
            f"but no set-up module holds the parameters of this {type(optimizer).__name__}; set the module up "
            "first (fabric.setup(model) or fabric.setup(model, optimizer)) or pass guard_nonfinite=False."
        )

    def before_step(self, optimizer: Any, device: torch.device, precision: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Run the guard for one step; returns the step's keyword arguments (a closure wrapped)."""
        module, step = self.module_of(optimizer), self.step
        self.step += 1
        losses, self._losses = self._losses, []
        if "closure" in kwargs:
            return {**kwargs, "closure": guarded_closure(self.guard, kwargs["closure"], module, device, step, precision)}
        loss = torch.stack([t.double().sum() for t in losses]).sum() if losses else None
        finding = self.guard.check(
            module, loss, world_group(), device, step, check_gradients=gradients_checked_by_guard(precision)
        )
        if finding is not None:
            rank_zero_warn(self.guard.skip_message(finding, step))
        return kwargs
