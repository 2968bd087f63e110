"""Which implementation an op runs: the csrc kernels on CUDA when they build, torch otherwise.

The choice is made per call from the tensor (device, dtype) and once per process for the build
(:func:`lightning_moe.ops.build.load_extension` caches its result). ``LIGHTNING_MOE_KERNELS``
forces a path: ``auto`` (default), ``csrc`` (raise if the kernels are unavailable), ``torch``; it is
read once per process, by :func:`lightning_moe.resources.kernels_mode`.
"""

from __future__ import annotations

import warnings
from functools import cache
from types import ModuleType

import torch

from lightning_moe.resources import kernels_mode

__all__ = ["csrc_extension", "SUPPORTED_KERNEL_DTYPES"]

SUPPORTED_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@cache
def _warn_dtype_once(dtype: torch.dtype) -> None:
    warnings.warn(f"lightning_moe: no csrc kernel for dtype {dtype}; using the torch path.", stacklevel=3)


def csrc_extension(t: torch.Tensor) -> ModuleType | None:
    """The compiled extension if ``t`` can use it, else ``None`` (the torch path)."""
    if t.device.type != "cuda":
        return None
    mode = kernels_mode()
    if mode == "torch":
        return None
    if t.dtype.is_floating_point and t.dtype not in SUPPORTED_KERNEL_DTYPES:
        _warn_dtype_once(t.dtype)
        return None
    from lightning_moe.ops.build import load_extension

    ext = load_extension()
    if ext is None and mode == "csrc":
        raise RuntimeError(
            "LIGHTNING_MOE_KERNELS=csrc but the csrc extension is unavailable (see the warning above); "
            "unset it to fall back to torch."
        )
    return ext
