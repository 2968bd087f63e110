"""JIT build and load of the optional CUTLASS kernels in ``csrc/cutlass/`` (Hopper only).

The grouped weight-gradient GEMM there (``csrc/cutlass/grouped_wgrad_sm90.cuh``) is a CUTLASS 3
warp-specialised kernel: wgmma and TMA, so it is compiled for ``sm_90a`` and runs on sm_90 GPUs
(H100, H200) only. It needs the CUTLASS headers, which lightning-moe does not ship or require:

* ``pip install nvidia-cutlass`` (the headers come inside its ``cutlass_library`` package), or
* ``LIGHTNING_MOE_CUTLASS_DIR=/path/to/cutlass`` (a checkout: ``include/`` and ``tools/util/include/``).

The sources sit in ``csrc/cutlass/`` of a source checkout or ``lightning_moe/_csrc/cutlass/`` of
an installed wheel (:func:`lightning_moe.resources.csrc_dir`); :func:`cutlass_kernel_files` lists
every file a build reads. Environment: ``LIGHTNING_MOE_CUTLASS_DIR`` (above),
``LIGHTNING_MOE_KERNELS=torch`` (never build) and ``LIGHTNING_MOE_CACHE`` (the build cache), as
in ``ops/build.py``, each read once per process by :mod:`lightning_moe.resources`; nothing else.

:func:`load_cutlass_extension` returns ``torch.ops.lightning_moe_cutlass_C`` or ``None``. Missing
headers, another GPU or ``LIGHTNING_MOE_KERNELS=torch`` give ``None`` quietly (the kernels are an
optional accelerator; :func:`cutlass_unavailable_reason` says why); a failed build warns once with
the compiler's first error line. Builds are cached like ``csrc/``'s (``ops/build.py``), keyed also
by the CUTLASS version header.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lightning_moe import resources
from lightning_moe.ops import build

__all__ = [
    "cutlass_include_dirs",
    "cutlass_kernel_files",
    "cutlass_sources",
    "cutlass_unavailable_reason",
    "load_cutlass_extension",
]

_NAME = "lightning_moe_cutlass_C"
CUDA_FLAGS: tuple[str, ...] = (
    "-O3",
    "-std=c++17",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-gencode=arch=compute_90a,code=sm_90a",  # wgmma / TMA: the "a" target, sm_90 only
)


def cutlass_include_dirs() -> tuple[Path, Path] | None:
    """``(include, tools/util/include)`` of the CUTLASS found, or ``None``."""
    explicit = resources.cutlass_dir()
    if explicit is not None:
        root = explicit
    else:
        try:
            spec = importlib.util.find_spec("cutlass_library")  # nvidia-cutlass; not imported
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(next(iter(spec.submodule_search_locations))) / "source"
    include, util = root / "include", root / "tools" / "util" / "include"
    if not (include / "cutlass" / "cutlass.h").is_file() or not (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
        return None
    return include, util


def _root() -> Path:
    return build.csrc_dir() / "cutlass"


def cutlass_sources() -> list[Path]:
    """The ``.cu`` files and the binding of ``csrc/cutlass/``."""
    return build._sources(_root())


def cutlass_kernel_files() -> list[Path]:
    """Every file of ``csrc/cutlass/`` a build reads (sources, then headers); CUTLASS's own are not listed."""
    return build.kernel_files(_root())


def cutlass_unavailable_reason() -> str | None:
    """Why the CUTLASS kernels cannot be used here (cheap checks, no compiler run); ``None`` if they can."""
    if resources.kernels_mode() == "torch":
        return "LIGHTNING_MOE_KERNELS=torch"
    if torch.version.cuda is None or not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"the CUTLASS kernels are built for sm_90 (H100/H200); this GPU is sm_{capability[0]}{capability[1]}"
    if cutlass_include_dirs() is None:
        return "CUTLASS headers not found (pip install nvidia-cutlass, or set LIGHTNING_MOE_CUTLASS_DIR)"
    toolchain = build._toolchain_reason()
    if toolchain is not None:
        return toolchain
    if not all(p.exists() for p in cutlass_sources()):
        return f"kernel sources not found under {_root()} (this lightning-moe lacks its csrc/ files; reinstall it)"
    return None


def _build_key(include: Path) -> str:
    version = include / "cutlass" / "version.h"
    return build._build_key(cutlass_sources(), _root(), CUDA_FLAGS, prefix="cutlass-", extra=(version,))


@functools.cache
def _build() -> tuple[ModuleType | None, str | None]:
    reason = cutlass_unavailable_reason()
    if reason is not None:
        return None, reason
    include, util = cutlass_include_dirs()  # type: ignore[misc]  # checked by the reason above
    ops, reason = build._compile_and_load(_NAME, cutlass_sources(), _build_key(include), CUDA_FLAGS, (include, util))
    if ops is None:
        warnings.warn(
            f"lightning_moe: CUTLASS kernels unavailable ({reason}); the cuBLAS and torch paths are used instead.",
            RuntimeWarning,
            stacklevel=3,
        )
    return ops, reason


def load_cutlass_extension() -> ModuleType | None:
    """``torch.ops.lightning_moe_cutlass_C``, or ``None`` when the CUTLASS kernels are unavailable."""
    return _build()[0]
