"""Rank liveness: every rank heartbeats into the c10d store, a monitor names a rank that died.

A collective over gloo or NCCL whose peer died fails with "Connection reset by peer" (or waits
until the process group's timeout) and never says which rank is gone. Each rank therefore runs
two daemon threads (not the training loop, so a slow step or a long checkpoint write never stops
the heartbeat):

1. the heartbeat sets ``beat/<rank>`` = ``"<pid> <host> <counter>"`` every ``interval_s``
   (``"<pid> <host> done"`` at a clean interpreter exit);
2. the monitor reads every rank's value (one ``multi_get``) every ``interval_s``. A rank is dead
   when its process is gone (same host: ``os.kill(pid, 0)`` and ``/proc/<pid>/stat``, so a
   SIGKILL is seen within one interval) or its value has not changed for ``threshold_s`` (by
   this rank's monotonic clock, so host clocks need not agree). An unreachable store is rank 0's
   death when rank 0's process is gone (Lightning's launcher hosts the store in rank 0).

On a dead rank the monitor writes one line naming it (global rank and layout coordinates) to
stderr, keeps it as :attr:`RankWatchdog.verdict` (a failing collective's exception gets it as a
note), gives the main thread ``grace_s`` to end by its own error, then ends the process with exit
code 1 (``os._exit``: a thread cannot interrupt a collective blocked in C++).

The store connection is a clone of the default one (its own socket, a short timeout), keys under
``lightning_moe_liveness/``. Cost: one ``set`` and one ``multi_get`` of ``world_size`` keys per
rank per interval on the store's host.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol
from lightning_moe.resources import pid_alive

__all__ = [
    "DeadRank",
    "LivenessMonitor",
    "LivenessStore",
    "RankWatchdog",
    "check_liveness_timeout",
    "collective_timeout",
    "ensure_watchdog",
    "is_collective_failure",
    "pid_alive",
    "running_watchdog",
]

_PREFIX = "lightning_moe_liveness/"


class LivenessStore(Protocol):
    """The part of ``torch.distributed.Store`` the watchdog uses."""

    def set(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...


@dataclass(frozen=True, slots=True)
class DeadRank:
    """A rank found dead and why (``reason`` completes "rank N ...")."""

    rank: int
    reason: str


def _beat_key(rank: int) -> str:
    return f"beat/{rank}"


class LivenessMonitor:
    """The monitor's decisions, without threads or a store: fed values and a clock.

    Args:
        rank: this rank (never reported).
        world_size: number of ranks.
        threshold_s: a rank whose value has not changed for this long is dead.
        host: this host's name (processes of the same host are checked by pid).
        clock: monotonic seconds.
        alive: ``pid -> bool`` for processes of this host.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        threshold_s: float,
        *,
        host: str,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int], bool] = pid_alive,
    ) -> None:
        self.rank, self.world_size, self.threshold_s = rank, world_size, threshold_s
        self.host, self._clock, self._alive = host, clock, alive
        self._start = clock()
        self._value: dict[int, bytes] = {}
        self._changed: dict[int, float] = {}
        self._pid: dict[int, tuple[int, str]] = {}
        self.done: set[int] = set()
        self._lost_since: float | None = None

    def observe(self, values: Mapping[int, bytes | None]) -> list[DeadRank]:
        """Dead ranks given each rank's current value (``None``: not written yet)."""
        now = self._clock()
        self._lost_since = None
        dead: list[DeadRank] = []
        for r in range(self.world_size):
            if r == self.rank or r in self.done:
                continue
            value = values.get(r)
            if value is None:
                if now - self._start > self.threshold_s:
                    dead.append(DeadRank(r, f"sent no heartbeat in {now - self._start:.1f} s"))
                continue
            parts = value.decode("utf-8", "replace").split(" ")
            if len(parts) != 3 or not parts[0].isdigit():
                continue
            pid, host, state = int(parts[0]), parts[1], parts[2]
            self._pid[r] = (pid, host)
            if state == "done":
                self.done.add(r)
                continue
            if value != self._value.get(r):
                self._value[r], self._changed[r] = value, now
            if host == self.host and not self._alive(pid):
                dead.append(DeadRank(r, f"is gone: its process {pid} on {host} no longer runs"))
            elif now - self._changed[r] > self.threshold_s:
                dead.append(DeadRank(r, f"sent no heartbeat for {now - self._changed[r]:.1f} s"))
        return dead

    def store_lost(self) -> list[DeadRank]:
        """Dead ranks when a read of the store failed; empty when rank 0 had exited cleanly.

        Rank 0's process gone (same host) is its death at once; otherwise the store must have
        failed for ``threshold_s`` in a row (a loaded store host answers late, not never).
        """
        now = self._clock()
        if self._lost_since is None:
            self._lost_since = now
        if self.rank == 0 or 0 in self.done:
            return []
        pid, host = self._pid.get(0, (-1, ""))
        if host == self.host and not self._alive(pid):
            return [DeadRank(0, f"is gone: its process {pid} on {host} no longer runs (it hosted the c10d store)")]
        if now - self._lost_since > self.threshold_s:
            return [DeadRank(0, f"stopped answering: the c10d store it hosts failed for {now - self._lost_since:.1f} s")]
        return []


def is_collective_failure(exception: BaseException) -> bool:
    """True for the errors a collective raises when a peer died (gloo/NCCL connection errors)."""
    import torch.distributed as dist

    if isinstance(exception, dist.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        w in text for w in ("Connection reset", "Connection closed", "peer", "Broken pipe", "NCCL", "gloo")
    )


class RankWatchdog:
    """Heartbeat and monitor threads for one process (see the module docstring).

    Args:
        store: the store (a clone of the default store with :meth:`from_default_store`).
        rank: this global rank.
        world_size: number of ranks.
        threshold_s: seconds without a heartbeat after which a rank is dead.
        owner: the name that starts the error line (the strategy's class name).
        describe: ``rank -> str`` coordinates of a rank in the layout (``""`` for none).
        interval_s: heartbeat and monitor period.
        grace_s: seconds the main thread gets to end by its own error after a verdict.
        exit_fn: called with 1 to end the process (``os._exit``).
    """

    def __init__(
        self,
        store: LivenessStore,
        rank: int,
        world_size: int,
        threshold_s: float,
        *,
        owner: str,
        describe: Callable[[int], str] = lambda r: "",
        interval_s: float = 0.5,
        grace_s: float = 5.0,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.owner, self.describe = owner, describe
        self.interval_s, self.grace_s, self._exit_fn = interval_s, grace_s, exit_fn
        self.host = socket.gethostname().replace(" ", "_")
        self.monitor = LivenessMonitor(rank, world_size, threshold_s, host=self.host)
        self.verdict: str | None = None
        self._found = threading.Event()
        self._stop = threading.Event()
        self._counter = 0
        self._store_gone = False  # rank 0 finished and its store went with it
        self._threads: list[threading.Thread] = []

    @classmethod
    def from_default_store(cls, rank: int, world_size: int, threshold_s: float, **kwargs: Any) -> RankWatchdog:
        """A watchdog on a clone of the default process group's store (its own connection)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        clone = _get_default_store().clone()
        clone.set_timeout(timedelta(seconds=10))
        return cls(dist.PrefixStore(_PREFIX, clone), rank, world_size, threshold_s, **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Write the first heartbeat, start both threads, mark a clean exit at interpreter exit."""
        self._beat()
        for name, target in (("heartbeat", self._heartbeat_loop), ("monitor", self._monitor_loop)):
            thread = threading.Thread(target=target, name=f"lightning-moe-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        atexit.register(self._at_exit)

    def stop(self, clean: bool) -> None:
        """Stop both threads; ``clean`` tells the other ranks this one ended on purpose."""
        self._stop.set()
        if clean and not self._store_gone:
            try:
                self.store.set(_beat_key(self.rank), f"{os.getpid()} {self.host} done")
            except Exception:  # noqa: BLE001 # the store's host may have exited first
                pass

    def _at_exit(self) -> None:
        clean = getattr(sys, "last_value", None) is None and self.verdict is None
        self.stop(clean=clean)
        if clean and self.rank == 0:  # the store may live in this process: let the others read "done"
            time.sleep(2 * self.interval_s)

    def wait_verdict(self, timeout_s: float) -> str | None:
        """The verdict line, waiting up to ``timeout_s`` for the monitor to find a dead rank."""
        self._found.wait(timeout_s)
        return self.verdict

    # ---- threads --------------------------------------------------------------------------------

    def _beat(self) -> None:
        self._counter += 1
        self.store.set(_beat_key(self.rank), f"{os.getpid()} {self.host} {self._counter}")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 # the monitor reports an unreachable store
                if 0 in self.monitor.done:  # rank 0 finished and took the store with it
                    self._store_gone = True
                    return

    def read(self) -> dict[int, bytes | None]:
        """Every rank's current value (``None`` where not written yet)."""
        keys = [_beat_key(r) for r in range(self.world_size)]
        if self.store.check(keys):
            return dict(enumerate(self.store.multi_get(keys)))
        present = [r for r in range(self.world_size) if self.store.check([keys[r]])]
        got = dict(zip(present, self.store.multi_get([keys[r] for r in present]), strict=True)) if present else {}
        return {r: got.get(r) for r in range(self.world_size)}

    def check_once(self) -> list[DeadRank]:
        """One monitor step: read the store, return the dead ranks."""
        try:
            values = self.read()
        except Exception:  # noqa: BLE001 # connection refused/reset, timeout: the store's host
            if self._stop.is_set():
                return []
            dead = self.monitor.store_lost()
            if 0 in self.monitor.done:  # rank 0 finished and took the store with it: nothing to watch
                self._store_gone = True
                self._stop.set()
            return dead
        return self.monitor.observe(values)

    def message(self, dead: list[DeadRank]) -> str:
        """The one-line error naming ``dead``."""
        named = []
        for d in dead:
            where = self.describe(d.rank)
            named.append(f"rank {d.rank}{f' ({where})' if where else ''} {d.reason}")
        return (
            f"{self.owner}: {'; '.join(named)}; rank {self.rank} stops with exit code 1 "
            f"(a dead rank's own output, above, holds its cause if it printed one)."
        )

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            dead = self.check_once()
            if not dead or self._stop.is_set():
                continue
            self.verdict = self.message(dead)
            sys.stderr.write(f"[rank{self.rank}]: {self.verdict}\n")
            sys.stderr.flush()
            self._found.set()
            self._stop.wait(self.grace_s)
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit_fn(1)
            return


_running: dict[str, Any] = {}  # the process's watchdog and the default process group it watches


def ensure_watchdog(rank: int, world_size: int, threshold_s: float, **kwargs: Any) -> RankWatchdog | None:
    """This process's watchdog over the current default process group, started once.

    A strategy calls it from every ``setup_environment``; a second fit in the same process (same
    default group) keeps the running one. A new default group replaces it. A default store that
    cannot open a second connection (an in-memory test store) gets no watchdog (``None``).
    """
    from torch.distributed.distributed_c10d import _get_default_group

    group = _get_default_group()
    current = _running.get("watchdog")
    if current is not None and _running.get("group") is group:
        return current
    if current is not None:
        current.stop(clean=True)
    try:
        watchdog = RankWatchdog.from_default_store(rank, world_size, threshold_s, **kwargs)
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    watchdog.start()
    _running.update(watchdog=watchdog, group=group)
    return watchdog


def running_watchdog() -> RankWatchdog | None:
    """The watchdog :func:`ensure_watchdog` started, if any."""
    return _running.get("watchdog")


def collective_timeout(owner: str, timeout: float | timedelta | None) -> timedelta | None:
    """``timeout`` (seconds or a timedelta; ``None``: torch's default) as init_process_group takes it."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{owner}: timeout={timeout!r} must be seconds (a number) or a datetime.timedelta; set e.g. timeout=1800."
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{owner}: timeout={timeout!r} must be a positive, finite number of seconds; set e.g. 1800.")
    return timedelta(seconds=seconds)


def check_liveness_timeout(owner: str, value: float | None) -> float | None:
    """``rank_liveness_timeout_s`` checked: ``None`` (off) or a finite number of seconds >= 2."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: rank_liveness_timeout_s={value!r} must be seconds (a number) or None (off).")
    if not math.isfinite(value) or value < 2:
        raise ValueError(
            f"{owner}: rank_liveness_timeout_s={value!r} must be finite and >= 2 s (heartbeats come every 0.5 s); "
            "set e.g. 30, or None to turn the watchdog off."
        )
    return float(value)
