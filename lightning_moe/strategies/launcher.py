"""Lightning's subprocess script launcher, with a child-process observer that lets the watchdog speak first.

Lightning's launcher (the Trainer's and Fabric's) starts, in the process that launched the
others, a thread that polls the children every few seconds and, once one has exited non-zero,
SIGKILLs the others and the launching process itself. The rank-liveness watchdog
(``parallel/liveness.py``) names a dead rank within about one heartbeat interval, but the
observer's poll may fall first: the user then sees the launching process killed without the line
naming the dead rank, or without its own error.

:class:`WatchdogFirstObserver` waits for this process's watchdog before that kill: up to the
watchdog's threshold + 2 s for its verdict, then, when one came, the watchdog's grace period + 1 s,
because the watchdog then ends the process itself (exit code 1) once the main thread has had its
chance to raise. Only when the process is still alive after that (or runs no watchdog) does
Lightning's kill follow. :class:`WatchdogFirstLauncher` (Trainer) and
:class:`FabricWatchdogFirstLauncher` (Fabric) start that observer instead of Lightning's.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import (
    _ChildProcessObserver,
)
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_moe.parallel.liveness import running_watchdog

__all__ = [
    "FabricWatchdogFirstLauncher",
    "WatchdogFirstLauncher",
    "WatchdogFirstObserver",
    "fabric_launcher_for",
    "trainer_launcher_for",
]

VERDICT_MARGIN_S = 2.0  # beyond the watchdog's threshold: its monitor reads the store every interval
EXIT_MARGIN_S = 1.0  # beyond the watchdog's grace period: its own exit needs a moment to happen


class _Monitor(Protocol):
    threshold_s: float


class LivenessVerdicts(Protocol):
    """The part of :class:`~lightning_moe.parallel.liveness.RankWatchdog` the observer waits on."""

    monitor: _Monitor
    grace_s: float

    def wait_verdict(self, timeout_s: float) -> str | None: ...


class WatchdogFirstObserver(_ChildProcessObserver):
    """Lightning's child-process observer whose kill waits for this process's watchdog first.

    Args:
        main_pid: the launching process (killed last, as Lightning does).
        child_processes: the ranks this process started.
        sleep_period: seconds between two polls of the children.
        watchdog: the running watchdog, looked up when a child has died (it starts after the
            observer, in the strategy's ``setup_environment``); ``None`` when there is none.
        sleep: waits the given seconds (a fake in tests).
    """

    def __init__(
        self,
        main_pid: int,
        child_processes: list[subprocess.Popen],
        sleep_period: int = 5,
        *,
        watchdog: Callable[[], LivenessVerdicts | None] = running_watchdog,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=sleep_period)
        self._watchdog, self._sleep = watchdog, sleep

    def wait_for_watchdog(self) -> str | None:
        """Give the watchdog its turn; its verdict (``None``: no watchdog, or none in time).

        With a verdict the watchdog ends this process itself within its grace period, so this
        returns only if it did not.
        """
        watchdog = self._watchdog()
        if watchdog is None:
            return None
        verdict = watchdog.wait_verdict(watchdog.monitor.threshold_s + VERDICT_MARGIN_S)
        if verdict is not None:
            self._sleep(watchdog.grace_s + EXIT_MARGIN_S)
        return verdict

    @override
    def _terminate_all(self) -> None:
        self.wait_for_watchdog()
        super()._terminate_all()


def _launch_watched(launcher: _SubprocessScriptLauncher | _FabricSubprocessScriptLauncher) -> None:
    """What Lightning's ``launch`` does before calling the function, with :class:`WatchdogFirstObserver`."""
    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not launcher.cluster_environment.creates_processes_externally:
        launcher._call_children_scripts()
        WatchdogFirstObserver(main_pid=os.getpid(), child_processes=launcher.procs).start()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)


class WatchdogFirstLauncher(_SubprocessScriptLauncher):
    """The Trainer's subprocess script launcher, its children watched by :class:`WatchdogFirstObserver`."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        _launch_watched(self)
        return function(*args, **kwargs)


class FabricWatchdogFirstLauncher(_FabricSubprocessScriptLauncher):
    """Fabric's subprocess script launcher, its children watched by :class:`WatchdogFirstObserver`."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        _launch_watched(self)
        return function(*args, **kwargs)


def _checked_environment(owner: str, environment: ClusterEnvironment | None) -> ClusterEnvironment:
    if environment is None:
        raise ValueError(
            f"{owner}: the launcher is configured before the strategy has a cluster environment; "
            "pass the strategy to Trainer(strategy=...) or Fabric(strategy=...), which set it first."
        )
    return environment


def trainer_launcher_for(strategy: Any) -> WatchdogFirstLauncher | None:
    """The Trainer strategy's launcher (``None`` where the cluster starts the processes)."""
    environment = _checked_environment(type(strategy).__name__, strategy.cluster_environment)
    if environment.creates_processes_externally:
        return None
    return WatchdogFirstLauncher(environment, strategy.num_processes, strategy.num_nodes)


def fabric_launcher_for(strategy: Any) -> FabricWatchdogFirstLauncher | None:
    """The Fabric strategy's launcher (``None`` where the cluster starts the processes)."""
    environment = _checked_environment(type(strategy).__name__, strategy.cluster_environment)
    if environment.creates_processes_externally:
        return None
    return FabricWatchdogFirstLauncher(environment, strategy.num_processes, strategy.num_nodes)
