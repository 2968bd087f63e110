"""Where the files that are not Python live: the CUDA kernel sources and the recipes.

The repository keeps them at its top level, beside the package: ``csrc/`` (kernels, with the
optional CUTLASS ones in ``csrc/cutlass/``) and ``configs/`` (one LightningCLI YAML per recipe).
The wheel maps both into the package (``setup.py``'s ``package_dir``), where importlib.resources
finds them:

* source checkout (editable install): ``<repo>/csrc/`` and ``<repo>/configs/``;
* installed wheel: ``lightning_moe/_csrc/`` and ``lightning_moe/_configs/``.

:func:`csrc_dir` and :func:`configs_dir` return the packaged directory when it exists and the
checkout's otherwise. :func:`resolve_recipe` turns what a user gives ``--config`` into a file: an
existing path wins, then a bare recipe name (``tiny_moe`` or ``tiny_moe.yaml``) is looked up among
:func:`recipe_names`.

The machine facts the package takes from the environment are read here and nowhere else, each once
per process (a cached function; :func:`reread_environment` forgets them, for tests that change a
variable):

* ``LIGHTNING_MOE_KERNELS`` (:func:`kernels_mode`): ``auto`` (unset or empty), ``csrc`` or
  ``torch``: whether the csrc kernels are built on this machine. Case and surrounding whitespace do
  not matter; any other value is a ``ValueError`` naming it.
* ``LIGHTNING_MOE_CACHE`` (:func:`build_cache_dir`): the root of the kernel build cache, default
  ``~/.cache/lightning_moe``.
* ``LIGHTNING_MOE_CUTLASS_DIR`` (:func:`cutlass_dir`): a CUTLASS checkout for the optional
  kernels, instead of the ``nvidia-cutlass`` package's headers.

Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
from pathlib import Path
from typing import Literal, get_args

__all__ = [
    "pid_alive",
    "RECIPE_SUFFIX",
    "KernelsMode",
    "build_cache_dir",
    "configs_dir",
    "csrc_dir",
    "cutlass_dir",
    "kernels_mode",
    "parse_kernels_mode",
    "recipe_names",
    "recipe_path",
    "reread_environment",
    "resolve_recipe",
]

KernelsMode = Literal["auto", "csrc", "torch"]

RECIPE_SUFFIX = ".yaml"
_PACKAGED_CSRC = "_csrc"
_PACKAGED_CONFIGS = "_configs"
# What a recipe name may look like: one file name, no directory, no YAML syntax.
_BARE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _package_dir() -> Path:
    """The installed ``lightning_moe/`` directory (a real directory: pip unpacks wheels)."""
    root = importlib.resources.files("lightning_moe")
    return root if isinstance(root, Path) else Path(__file__).resolve().parent


def _resource_dir(packaged: str, top_level: str) -> Path:
    inside = _package_dir() / packaged
    if inside.is_dir():
        return inside
    checkout = _package_dir().parent / top_level
    # A checkout has the top-level folder; an installed copy without its data reports the
    # packaged location, which is where the files should have been.
    return checkout if checkout.is_dir() else inside


def csrc_dir() -> Path:
    """The kernel sources: ``lightning_moe/_csrc`` in a wheel, ``<repo>/csrc`` in a checkout."""
    return _resource_dir(_PACKAGED_CSRC, "csrc")


def configs_dir() -> Path:
    """The recipes: ``lightning_moe/_configs`` in a wheel, ``<repo>/configs`` in a checkout."""
    return _resource_dir(_PACKAGED_CONFIGS, "configs")


def recipe_names() -> list[str]:
    """Names of the packaged recipes (file names without ``.yaml``), sorted."""
    return sorted(p.stem for p in configs_dir().glob(f"*{RECIPE_SUFFIX}"))


def _unknown(value: str) -> ValueError:
    names = ", ".join(recipe_names()) or f"(none under {configs_dir()})"
    return ValueError(
        f"lightning-moe: --config={value} names no file and no packaged recipe; "
        f"choose one of {names}, or give an existing path."
    )


def recipe_path(name: str) -> Path:
    """The packaged recipe ``name`` (``tiny_moe`` or ``tiny_moe.yaml``).

    Raises ``ValueError`` listing the packaged recipes when there is none of that name.
    """
    stem = name.removesuffix(RECIPE_SUFFIX)
    path = configs_dir() / f"{stem}{RECIPE_SUFFIX}"
    if not _BARE_NAME.fullmatch(stem) or not path.is_file():
        raise _unknown(name)
    return path


def resolve_recipe(value: str) -> str:
    """What ``--config`` should receive for ``value``.

    1. An existing file: ``value`` unchanged (a path wins over a recipe of the same name).
    2. A bare name (no directory part): its packaged recipe's path.
    3. A missing ``*.yaml`` path: ``ValueError`` listing the packaged recipes, as for an
       unknown name in 2.
    4. Anything else (inline YAML or JSON): ``value`` unchanged, for the parser to judge.
    """
    if Path(value).expanduser().is_file():
        return value
    if _BARE_NAME.fullmatch(value):
        return str(recipe_path(value))
    if value.endswith(RECIPE_SUFFIX) and "\n" not in value:
        raise _unknown(value)
    return value


def parse_kernels_mode(raw: str | None) -> KernelsMode:
    """The kernels mode a value of ``LIGHTNING_MOE_KERNELS`` names (``None`` or blank: ``auto``)."""
    mode = (raw or "").strip().lower() or "auto"
    if mode not in get_args(KernelsMode):
        raise ValueError(
            f"LIGHTNING_MOE_KERNELS={raw!r} is unknown; choose one of {', '.join(get_args(KernelsMode))}, "
            "or unset it (auto)."
        )
    return mode  # type: ignore[return-value]


@functools.cache
def kernels_mode() -> KernelsMode:
    """``LIGHTNING_MOE_KERNELS`` of this process, read once: whether the csrc kernels are built here."""
    return parse_kernels_mode(os.environ.get("LIGHTNING_MOE_KERNELS"))


@functools.cache
def build_cache_dir() -> Path:
    """Root of the kernel build cache: ``$LIGHTNING_MOE_CACHE`` or ``~/.cache/lightning_moe``, read once."""
    root = os.environ.get("LIGHTNING_MOE_CACHE", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lightning_moe"


@functools.cache
def cutlass_dir() -> Path | None:
    """``$LIGHTNING_MOE_CUTLASS_DIR`` (a CUTLASS checkout), read once; ``None`` when unset or blank."""
    root = os.environ.get("LIGHTNING_MOE_CUTLASS_DIR", "").strip()
    return Path(root).expanduser() if root else None


def reread_environment() -> None:
    """Forget the machine facts read so far; the next call of each reads the environment again."""
    for read in (kernels_mode, build_cache_dir, cutlass_dir):
        read.cache_clear()


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` of this host runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill said it exists
    return state not in ("Z", "X")
