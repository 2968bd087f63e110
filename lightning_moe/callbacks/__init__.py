"""Callbacks that attach to any LightningModule holding :class:`~lightning_moe.MoELayer` s.

Each callback lives in its own module and is imported lazily on first attribute access, so
``import lightning_moe.callbacks`` stays cheap (matplotlib, tensorboard and the like are only
loaded by the callback that needs them). ``lightning_moe.callbacks.RouterReplay`` works both in
Python and as a LightningCLI ``class_path``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_moe.callbacks.echo import ECHOExpertCloning as ECHOExpertCloning
    from lightning_moe.callbacks.monitor import MoEMonitor as MoEMonitor
    from lightning_moe.callbacks.router_replay import RouterReplay as RouterReplay
    from lightning_moe.callbacks.step_timer import StepTimer as StepTimer

# public name -> module (under this package) that defines it
_MODULES: dict[str, str] = {
    "RouterReplay": "router_replay",
    "MoEMonitor": "monitor",
    "ECHOExpertCloning": "echo",
    "CPUOffload": "offload",
    "CUDAGraphCapture": "cuda_graphs",
    "StepTimer": "step_timer",
}
_HERE = Path(__file__).resolve().parent

# Only names whose module is present are exported (the package is assembled file by file).
__all__ = [name for name, module in _MODULES.items() if (_HERE / f"{module}.py").is_file()]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
