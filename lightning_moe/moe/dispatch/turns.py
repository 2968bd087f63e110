"""Turn-taking of two computations so that one's all-to-all is in flight while the other computes.

A pipeline schedule's overlapped action runs one micro-batch's forward and another's backward
(on different stages of this rank). :meth:`CommTurns.run_pair` runs them as two sides that take
turns, never at the same time: the forward on the calling thread, which starts with the turn, and
the backward on a helper thread. An all-to-all issued with ``turns`` (``comm.exchange_rows``,
``comm.all_to_all_rows``) is issued asynchronously, then :meth:`CommTurns.hand_over` gives the
turn to the other side, which computes until it issues its own all-to-all (or ends) and hands the
turn back; only then does the first side wait for its all-to-all. One pair therefore runs::

    forward:  compute | A2A issued ........ wait | compute | A2A issued ...... wait | ...
    backward:         | compute | A2A issued ..........................  wait | compute ...

Only one side runs at a time, so each rank issues its collectives in one fixed order, the same on
every rank of a group (they run the same stages and layers), and the arithmetic is that of the two
sides one after the other. On a GPU the kernels one side launches while the other's all-to-all is
pending run beside that all-to-all on the process group's stream. The helper thread takes the
calling thread's accelerator device and stream. Outside :meth:`run_pair` (and once the other side
has ended) :meth:`hand_over` returns at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["CommTurns"]

_FIRST, _SECOND = 0, 1


class CommTurns:
    """Two sides of one overlapped action taking turns at their all-to-alls (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = _FIRST
        self._running: set[int] = set()

    def hand_over(self) -> None:
        """Called by the side holding the turn right after it issued an all-to-all: the other side
        runs until it hands the turn back or ends. At once when no pair runs or the other ended."""
        with self._cond:
            if len(self._running) < 2:
                return
            me = self._holder
            self._holder = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == me or (1 - me) not in self._running)
            self._holder = me

    def run_pair(self, first: Callable[[], None], second: Callable[[], None], name: str = "comm-turns") -> None:
        """Run ``first`` on this thread and ``second`` on a helper thread named ``name``, taking
        turns at :meth:`hand_over`; ``first`` starts. Re-raises either side's exception (the other
        side then runs to its end alone)."""
        with self._cond:
            if self._running:
                raise RuntimeError("CommTurns.run_pair: a pair is running already; pairs do not nest.")
            self._running = {_FIRST, _SECOND}
            self._holder = _FIRST
        errors: list[BaseException] = []
        helper = threading.Thread(target=self._side, args=(_SECOND, second, errors, _device_setter()), name=name)
        helper.start()
        try:
            self._side(_FIRST, first, errors, None)
        finally:
            helper.join()
        if errors:
            raise errors[0]

    def _side(
        self, side: int, work: Callable[[], None], errors: list[BaseException], on_start: Callable[[], None] | None
    ) -> None:
        try:
            if on_start is not None:
                on_start()
            with self._cond:
                self._cond.wait_for(lambda: self._holder == side)
            work()
        except BaseException as error:  # handed to run_pair, which re-raises it on the calling thread
            errors.append(error)
        finally:
            with self._cond:
                self._running.discard(side)
                self._holder = 1 - side
                self._cond.notify_all()


def _device_setter() -> Callable[[], None]:
    """Makes the calling thread's accelerator device and stream current on another thread."""
    if not torch.accelerator.is_available():
        return lambda: None
    index = torch.accelerator.current_device_index()
    stream = torch.accelerator.current_stream(index)

    def apply() -> None:
        torch.accelerator.set_device_index(index)
        torch.accelerator.set_stream(stream)

    return apply
