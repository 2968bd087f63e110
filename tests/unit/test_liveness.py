"""The rank-liveness monitor (fake store and clock), its threads, and the strategies' timeout options."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from lightning_moe.parallel.liveness import (
    LivenessMonitor,
    RankWatchdog,
    check_liveness_timeout,
    collective_timeout,
    pid_alive,
)
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeStore:
    """A dict with the three Store calls the watchdog makes; ``fail`` makes every call raise."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = False
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            if self.fail:
                raise ConnectionResetError("store gone")
            self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        if self.fail:
            raise ConnectionResetError("store gone")
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if self.fail:
            raise ConnectionResetError("store gone")
        return [self.data[k] for k in keys]


def beat(pid: int, host: str, n: int | str) -> bytes:
    return f"{pid} {host} {n}".encode()


def monitor(clock: Clock, gone: set[int], threshold: float = 10.0, rank: int = 0, world: int = 3) -> LivenessMonitor:
    return LivenessMonitor(rank, world, threshold, host="h0", clock=clock, alive=lambda pid: pid not in gone)


def test_changing_heartbeats_keep_ranks_alive_and_a_stale_one_is_named_after_the_threshold() -> None:
    clock, gone = Clock(), set()
    m = monitor(clock, gone)
    for n in range(5):  # 20 s of heartbeats every 4 s, with ranks on another host
        assert m.observe({1: beat(11, "h1", n), 2: beat(12, "h1", n)}) == []
        clock.t += 4.0
    assert m.observe({1: beat(11, "h1", 5), 2: beat(12, "h1", 4)}) == []  # rank 2 unchanged for 4 s
    clock.t += 6.5
    dead = m.observe({1: beat(11, "h1", 6), 2: beat(12, "h1", 4)})
    assert [d.rank for d in dead] == [2] and "no heartbeat for 10.5 s" in dead[0].reason


def test_a_gone_process_on_this_host_is_named_at_once_and_never_this_rank() -> None:
    clock, gone = Clock(), set()
    m = monitor(clock, gone, rank=1)
    values = {0: beat(10, "h0", 1), 1: beat(11, "h0", 1), 2: beat(12, "h0", 1)}
    assert m.observe(values) == []
    gone.update({11, 12})  # this rank's own pid "gone" must not name itself
    dead = m.observe(values)
    assert [d.rank for d in dead] == [2] and "process 12 on h0 no longer runs" in dead[0].reason


def test_a_remote_pid_is_not_checked_and_a_done_rank_is_never_named() -> None:
    clock, gone = Clock(), {11, 12}
    m = monitor(clock, gone)
    assert m.observe({1: beat(11, "h1", 1), 2: beat(12, "h0", "done")}) == []
    clock.t += 50.0
    assert [d.rank for d in m.observe({1: beat(11, "h1", 1), 2: beat(12, "h0", "done")})] == [1]


def test_a_rank_that_never_wrote_is_named_after_the_threshold() -> None:
    clock = Clock()
    m = monitor(clock, set())
    assert m.observe({1: beat(11, "h1", 1), 2: None}) == []
    clock.t += 10.5
    dead = m.observe({1: beat(11, "h1", 2), 2: None})
    assert [d.rank for d in dead] == [2] and "no heartbeat in" in dead[0].reason


def test_a_lost_store_names_rank_0_when_its_process_is_gone_or_after_the_threshold_not_when_it_finished() -> None:
    clock, gone = Clock(), set()
    m = monitor(clock, gone, rank=1)
    m.observe({0: beat(10, "h0", 1), 2: beat(12, "h0", 1)})
    assert m.store_lost() == []  # a slow store is not a dead one
    clock.t += 10.5
    assert [d.rank for d in m.store_lost()] == [0]
    m.observe({0: beat(10, "h0", 2), 2: beat(12, "h0", 2)})  # answered again: the clock restarts
    assert m.store_lost() == []
    gone.add(10)
    assert "process 10 on h0 no longer runs" in m.store_lost()[0].reason
    m.observe({0: beat(10, "h0", "done"), 2: beat(12, "h0", 3)})
    assert m.store_lost() == []


def test_pid_alive_for_this_process_and_a_reaped_child() -> None:
    import os
    import subprocess
    import sys

    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_the_watchdog_names_a_dead_rank_with_its_coordinates_and_ends_the_process() -> None:
    store, exits = FakeStore(), []
    store.set("beat/1", "999999999 otherhost 1")
    w = RankWatchdog(
        store, 0, 2, 2.0, owner="FoldedMoEStrategy", describe=lambda r: f"ep={r}",
        interval_s=0.05, grace_s=0.05, exit_fn=exits.append,
    )  # fmt: skip
    w.monitor.host = w.host = "thishost"
    w.start()
    try:
        assert w.wait_verdict(0.5) is None  # rank 1 is remote and fresh
        store.set("beat/1", f"999999999 {w.host} 2")  # now "on this host", and its pid does not exist
        verdict = w.wait_verdict(5.0)
        deadline = time.monotonic() + 5.0
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        w.stop(clean=True)
    assert verdict is not None and verdict.startswith("FoldedMoEStrategy: rank 1 (ep=1) is gone: its process 999999999")
    assert exits == [1]
    assert store.data["beat/0"].endswith(b" done")


def test_the_heartbeat_goes_on_while_the_main_thread_is_busy() -> None:
    store = FakeStore()
    w = RankWatchdog(store, 0, 1, 2.0, owner="X", interval_s=0.05, exit_fn=lambda code: None)
    w.start()
    try:
        first = store.data["beat/0"]
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # a busy Python loop holding the GIL between switches
            sum(range(1000))
        assert int(store.data["beat/0"].split()[2]) >= int(first.split()[2]) + 3
    finally:
        w.stop(clean=False)


@pytest.mark.parametrize(
    ("value", "expected"), [(120, timedelta(seconds=120)), (0.5, timedelta(seconds=0.5)), (None, None),
                            (timedelta(minutes=2), timedelta(minutes=2))],
)  # fmt: skip
def test_collective_timeout_takes_seconds_or_a_timedelta(value: object, expected: object) -> None:
    assert collective_timeout("S", value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error"), [(True, TypeError), ("30", TypeError), (0, ValueError), (-1.0, ValueError),
                         (float("nan"), ValueError), (float("inf"), ValueError), (timedelta(0), ValueError)],
)  # fmt: skip
def test_collective_timeout_refuses_bad_values(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"^S: timeout="):
        collective_timeout("S", value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error"), [(True, TypeError), ("30", TypeError), (1.0, ValueError),
                                              (float("nan"), ValueError), (-5, ValueError)])  # fmt: skip
def test_liveness_timeout_refuses_bad_values(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"^S: rank_liveness_timeout_s="):
        check_liveness_timeout("S", value)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [FoldedMoEStrategy, FabricFoldedMoEStrategy])
def test_strategies_pass_the_timeout_on_and_check_both_options(cls: type) -> None:
    strategy = cls(timeout=90, rank_liveness_timeout_s=None)
    assert strategy._timeout == timedelta(seconds=90) and strategy.rank_liveness_timeout_s is None
    assert cls()._timeout == timedelta(minutes=30) and cls().rank_liveness_timeout_s == 30.0
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: timeout=-1 must be a positive"):
        cls(timeout=-1)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: rank_liveness_timeout_s=0 must be finite"):
        cls(rank_liveness_timeout_s=0)


def test_a_failed_collective_gets_the_verdict_as_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.strategies.guards as guards

    stub = SimpleNamespace(monitor=SimpleNamespace(threshold_s=0.0), wait_verdict=lambda t: "S: rank 3 (ep=3) is gone")
    monkeypatch.setattr(guards, "running_watchdog", lambda: stub)
    strategy = FoldedMoEStrategy()
    failure = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    strategy.on_exception(failure)
    assert failure.__notes__ == ["S: rank 3 (ep=3) is gone"]
    other = ValueError("bad batch")
    strategy.on_exception(other)
    assert not hasattr(other, "__notes__")


# ---- the launcher's child-process observer waits for the watchdog ----------------------------------


class FakeChild:
    """A child process for the observer: exited with ``returncode`` (``None``: still running)."""

    def __init__(self, pid: int, returncode: int | None, events: list[tuple]) -> None:
        self.pid, self.returncode, self._events = pid, returncode, events

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self._events.append(("signal", self.pid, signum))


class FakeWatchdog:
    """Records how long the observer waits for a verdict; answers ``verdict``."""

    def __init__(self, verdict: str | None, events: list[tuple]) -> None:
        self.monitor = SimpleNamespace(threshold_s=7.0)
        self.grace_s, self.verdict, self._events = 3.0, verdict, events

    def wait_verdict(self, timeout_s: float) -> str | None:
        self._events.append(("wait_verdict", timeout_s))
        return self.verdict


def observed_death(monkeypatch: pytest.MonkeyPatch, watchdog: FakeWatchdog | None, events: list[tuple]) -> bool:
    """One poll of a WatchdogFirstObserver over a dead child and a live one; kills are recorded, not sent."""
    import os
    import signal

    from lightning_moe.strategies.launcher import WatchdogFirstObserver

    monkeypatch.setattr(os, "kill", lambda pid, signum: events.append(("kill", pid, signum)))
    children = [FakeChild(11, -signal.SIGKILL, events), FakeChild(12, None, events)]
    observer = WatchdogFirstObserver(
        main_pid=10, child_processes=children, watchdog=lambda: watchdog,  # type: ignore[arg-type]
        sleep=lambda s: events.append(("sleep", s)),
    )  # fmt: skip
    return observer._run()


def test_the_observer_waits_for_the_verdict_and_the_watchdogs_own_exit_before_killing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    events: list[tuple] = []
    assert observed_death(monkeypatch, FakeWatchdog("rank 1 is gone", events), events)
    kill = signal.SIGKILL
    assert events == [
        ("wait_verdict", 7.0 + 2.0), ("sleep", 3.0 + 1.0),
        ("signal", 11, kill), ("signal", 12, kill), ("kill", 10, kill),
    ]  # fmt: skip


def test_the_observer_kills_after_the_verdict_wait_when_none_comes_and_at_once_without_a_watchdog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    kill = signal.SIGKILL
    events: list[tuple] = []
    assert observed_death(monkeypatch, FakeWatchdog(None, events), events)
    assert events == [("wait_verdict", 9.0), ("signal", 11, kill), ("signal", 12, kill), ("kill", 10, kill)]
    events.clear()
    assert observed_death(monkeypatch, None, events)
    assert events == [("signal", 11, kill), ("signal", 12, kill), ("kill", 10, kill)]


def test_the_observer_leaves_children_that_run_or_ended_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from lightning_moe.strategies.launcher import WatchdogFirstObserver

    events: list[tuple] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: events.append(("kill", pid, signum)))
    def watchdog() -> FakeWatchdog:
        return FakeWatchdog("rank 1 is gone", events)

    running = WatchdogFirstObserver(10, [FakeChild(11, None, events)], watchdog=watchdog)  # type: ignore[list-item]
    assert not running._run()
    clean = WatchdogFirstObserver(10, [FakeChild(11, 0, events)], watchdog=watchdog)  # type: ignore[list-item]
    assert clean._run()
    assert events == []


def test_both_strategies_launch_with_the_watchdog_first_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from lightning_moe.strategies.launcher import FabricWatchdogFirstLauncher, WatchdogFirstLauncher

    monkeypatch.delenv("LOCAL_RANK", raising=False)  # set: the processes exist already, no launcher
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FoldedMoEStrategy(ep=2), logger=False)
    assert type(trainer.strategy.launcher) is WatchdogFirstLauncher
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricFoldedMoEStrategy(ep=2))
    assert type(fabric.strategy.launcher) is FabricWatchdogFirstLauncher
