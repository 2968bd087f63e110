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
:func:`recipe_names`. Nothing here reads the environment or imports Lightning.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

__all__ = ["RECIPE_SUFFIX", "configs_dir", "csrc_dir", "recipe_names", "recipe_path", "resolve_recipe"]

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
