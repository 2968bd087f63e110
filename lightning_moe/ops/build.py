"""JIT build and load of the CUDA kernels in ``csrc/``, with a clean fallback to torch.

The sources are found by :func:`lightning_moe.resources.csrc_dir`: ``csrc/`` at the top of a
source checkout, ``lightning_moe/_csrc/`` inside an installed wheel (the same files);
:func:`kernel_files` lists every file a build reads.

:func:`load_extension` compiles ``csrc/*.cu`` and ``csrc/bindings.cpp`` with
``torch.utils.cpp_extension.load`` (ninja) the first time it is called in a process, and returns
the op namespace ``torch.ops.lightning_moe_C`` (the ops are registered with ``TORCH_LIBRARY``; see
``csrc/bindings.cpp`` for their schemas). Builds are cached on disk under
``$LIGHTNING_MOE_CACHE`` (default ``~/.cache/lightning_moe``), in a directory keyed by the
sources, the flags and the torch / CUDA / Python versions, so a stale build is never loaded.
Concurrent builds (several ranks on one node) are serialised by torch's lock file in that
directory.

Environment (machine facts only, each read once per process by :mod:`lightning_moe.resources`;
these three are the only ones the JIT builders use):

* ``LIGHTNING_MOE_KERNELS``: whether to build (below).
* ``LIGHTNING_MOE_CACHE``: the build cache directory (default ``~/.cache/lightning_moe``).
* ``LIGHTNING_MOE_CUTLASS_DIR``: a CUTLASS checkout for the optional kernels in ``csrc/cutlass/``
  (read by :mod:`lightning_moe.ops.build_cutlass`).

``LIGHTNING_MOE_KERNELS`` chooses what happens:

* ``auto`` (default): build when possible; otherwise return ``None`` and warn once, naming the
  reason (no CUDA device, torch without CUDA, GPU older than sm_80, no nvcc, no ninja, sources
  missing, or the compiler's first ``error`` line).
* ``csrc``: as ``auto``, but raise ``RuntimeError`` with the reason instead of returning ``None``.
* ``torch``: never build; return ``None`` silently.

Compiler flags: ``-O3``; SASS for sm_80 and sm_90 plus sm_90 PTX (newer GPUs JIT it). No
``--use_fast_math``: every kernel is bandwidth-bound, and the approximate ``expf`` / division
would only cost accuracy (the fp32 SwiGLU and router must match torch to 1e-5, and the router's
top-k must not flip on rounding).
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import get_args

import torch

from lightning_moe import resources
from lightning_moe.resources import KernelsMode

__all__ = ["cache_dir", "csrc_dir", "kernel_files", "load_extension"]

_MODES: tuple[str, ...] = get_args(KernelsMode)
_NAME = "lightning_moe_C"  # library name and TORCH_LIBRARY namespace
_CUDA_FLAGS: tuple[str, ...] = (
    "-O3",
    "-std=c++17",
    "-lineinfo",  # source lines for profilers; no runtime cost
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    # PTX for GPUs newer than sm_90, as its own flag: ninja runs commands through a shell,
    # where "code=[sm_90,compute_90]" would be a glob pattern.
    "-gencode=arch=compute_90,code=compute_90",
)
_CXX_FLAGS: tuple[str, ...] = ("-O3",)
_MIN_CAPABILITY = (8, 0)  # bf16x2 conversions and match_any in the kernels


def csrc_dir() -> Path:
    """The kernel sources: ``csrc/`` in a source checkout, ``lightning_moe/_csrc/`` in a wheel."""
    return resources.csrc_dir()


def cache_dir() -> Path:
    """Root of the build cache: ``$LIGHTNING_MOE_CACHE`` or ``~/.cache/lightning_moe``."""
    return resources.build_cache_dir()


def load_extension(mode: KernelsMode | None = None) -> ModuleType | None:
    """The compiled ops (``torch.ops.lightning_moe_C``), or ``None`` when they are unavailable.

    ``mode`` overrides ``LIGHTNING_MOE_KERNELS`` (``None`` reads it). The build is attempted
    once per process; in ``auto`` mode a failure warns once and later calls return ``None``
    quietly.
    """
    mode = resources.kernels_mode() if mode is None else mode
    if mode not in _MODES:
        raise ValueError(f"load_extension: mode={mode!r} is not a kernels mode; choose one of {', '.join(_MODES)}.")
    if mode == "torch":
        return None
    if mode == "csrc":
        ops, reason = _build()
        if ops is None:
            raise RuntimeError(
                f"LIGHTNING_MOE_KERNELS=csrc but the csrc kernels are unavailable: {reason}. "
                "Fix that, or unset LIGHTNING_MOE_KERNELS to fall back to torch."
            )
        return ops
    return _load_or_warn()


@functools.cache
def _load_or_warn() -> ModuleType | None:
    ops, reason = _build()
    if ops is None:
        warnings.warn(
            f"lightning_moe: csrc kernels unavailable ({reason}); using the torch path. "
            "Set LIGHTNING_MOE_KERNELS=torch to silence this, or =csrc to make it an error.",
            RuntimeWarning,
            stacklevel=3,
        )
    return ops


def _sources(root: Path | None = None) -> list[Path]:
    """The ``.cu`` files and the binding of ``root`` (default: ``csrc/``)."""
    root = csrc_dir() if root is None else root
    return sorted(root.glob("*.cu")) + [root / "bindings.cpp"]


def _headers(root: Path) -> list[Path]:
    """The headers of ``root`` (``*.cuh``, ``*.h``): part of every build's key."""
    return sorted(root.glob("*.cuh")) + sorted(root.glob("*.h"))


def kernel_files(root: Path | None = None) -> list[Path]:
    """Every file a build of ``root`` (default: ``csrc/``) reads: its sources, then its headers."""
    root = csrc_dir() if root is None else root
    return _sources(root) + _headers(root)


def _build_key(
    sources: list[Path],
    root: Path | None = None,
    flags: object = (_CUDA_FLAGS, _CXX_FLAGS),
    prefix: str = "",
    extra: tuple[Path, ...] = (),
) -> str:
    """Directory name for one build, ``{prefix}{versions}-{hash}``: changes with any source, header of
    ``root`` (default: ``csrc/``), ``extra`` file, flag or the torch / CUDA / Python version, so a
    stale build is never loaded."""
    root = csrc_dir() if root is None else root
    files = sorted(sources) + _headers(root) + list(extra)
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(repr(flags).encode())
    versions = f"torch{torch.__version__}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
    h.update(versions.encode())
    return f"{prefix}{versions}-{h.hexdigest()[:16]}".replace("+", "_")


def _first_error_line(text: str) -> str:
    """The first compiler/linker line that says ``error`` (nvcc: ``f.cu(12): error: ...``)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Error building extension"):
            continue  # torch's wrapper line, not the compiler's
        if re.search(r"\berror\b", ln, re.IGNORECASE):
            return ln
    return lines[0] if lines else "unknown build failure"


def _unavailable_reason() -> str | None:
    """Why the kernels cannot be built here, checked cheaply before invoking a compiler."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    capability = torch.cuda.get_device_capability()
    if capability < _MIN_CAPABILITY:
        return f"GPU sm_{capability[0]}{capability[1]} is older than sm_{_MIN_CAPABILITY[0]}{_MIN_CAPABILITY[1]}"
    toolchain = _toolchain_reason()
    if toolchain is not None:
        return toolchain
    missing = [str(p) for p in _sources() if not p.exists()]
    if missing or not list(csrc_dir().glob("*.cu")):
        return f"kernel sources not found under {csrc_dir()} (this lightning-moe lacks its csrc/ files; reinstall it)"
    return None


def _toolchain_reason() -> str | None:
    """Why nothing can be compiled here (no nvcc, no ninja); ``None`` when both are found."""
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not nvcc.exists():
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


@functools.cache
def _build() -> tuple[ModuleType | None, str | None]:
    """``(torch.ops.lightning_moe_C, None)`` after a successful build and load, else ``(None, reason)``."""
    reason = _unavailable_reason()
    if reason is not None:
        return None, reason
    return _compile_and_load(_NAME, _sources(), _build_key(_sources()), _CUDA_FLAGS, ())


def _compile_and_load(
    name: str, sources: list[Path], key: str, cuda_flags: tuple[str, ...], include_dirs: tuple[Path, ...]
) -> tuple[ModuleType | None, str | None]:
    """Build ``sources`` into the library ``name`` under the cache directory ``key`` and load it."""
    from torch.utils import cpp_extension

    build_dir = cache_dir() / key
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cannot create the build cache {build_dir}: {exc}"
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=list(_CXX_FLAGS),
            extra_cuda_cflags=list(cuda_flags),
            extra_include_paths=[str(p) for p in include_dirs],
            build_directory=str(build_dir),
            with_cuda=True,
            is_python_module=False,  # TORCH_LIBRARY registers the ops when the library loads
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use torch"
        # torch puts the captured compiler output into the RuntimeError's message.
        return None, f"build failed in {build_dir}: {_first_error_line(str(exc))}"
    return getattr(torch.ops, name), None
