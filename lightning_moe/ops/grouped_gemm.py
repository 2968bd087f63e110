"""Grouped GEMM over experts: ``y_RO[rows of e] = x_RD[rows of e] @ w_EDO[e]``.

Legend: R rows sorted by expert, D input width, O output width, E local experts.
``offs_E`` is the inclusive cumulative row count per expert (int32), the form
``torch.nn.functional.grouped_mm`` takes; rows past ``offs_E[-1]`` are ignored (left unwritten by
some backends, so callers never read them).

Backends (one facade, chosen once per ``GroupedExperts``):

* ``torch`` — ``F.grouped_mm`` (CUDA sm_90+, and CPU on torch >= 2.9). Needs every row stride
  16-byte aligned, i.e. D and O multiples of 8 in bf16 or 4 in fp32. For wide experts on Hopper
  the forward and data-gradient GEMMs run our CUTLASS grouped GEMM instead, when it is built
  (``ops/grouped_gemm_cutlass.py``: same contract, measured faster there; ``gemm_kernel`` and
  ``gemm_tile``, from ``KernelConfig``, choose); the weight gradient always runs ``F.grouped_mm``
  (the CUTLASS weight-gradient kernel pays only where it adds into an existing ``.grad``:
  ``ops/wgrad/``).
* ``loop`` — one matmul per expert; the reference, and the fallback for odd sizes.
* ``grouped_gemm`` — the ``grouped_gemm`` package, when importable (``ops/grouped_gemm_gg.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from lightning_moe.ops import grouped_gemm_cutlass

__all__ = [
    "GemmBackend",
    "grouped_mm_reference",
    "resolve_gemm_backend",
    "gmm",
    "gmm_wgrad",
    "offsets_from_counts",
]

GemmBackend = Literal["torch", "loop", "grouped_gemm"]


def offsets_from_counts(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum in int32 (``F.grouped_mm``'s ``offs``)."""
    return torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)


def _bounds(offs_E: torch.Tensor) -> list[int]:
    return [0] + offs_E.tolist()  # SYNC: the loop backend needs host-side row ranges


def grouped_mm_reference(x_RD: torch.Tensor, w_EDO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """One matmul per expert (the spec)."""
    bounds = _bounds(offs_E)
    y_RO = x_RD.new_zeros(x_RD.shape[0], w_EDO.shape[-1])
    for e in range(w_EDO.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y_RO[lo:hi] = x_RD[lo:hi] @ w_EDO[e]
    return y_RO


def _wgrad_reference(x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    bounds = _bounds(offs_E)
    E = offs_E.shape[0]
    dw_EDO = x_RD.new_zeros(E, x_RD.shape[1], dy_RO.shape[1])
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            dw_EDO[e] = x_RD[lo:hi].t() @ dy_RO[lo:hi]
    return dw_EDO


def _torch_gmm(
    x_RD: torch.Tensor, w_EDO: torch.Tensor, offs_E: torch.Tensor, kernel: str, tile: str
) -> torch.Tensor:
    if x_RD.shape[0] == 0:  # F.grouped_mm rejects the zero strides of an empty expanded grad
        return x_RD.new_zeros(0, w_EDO.shape[-1])
    tiling = grouped_gemm_cutlass.layer_tiling(x_RD, w_EDO, kernel, tile)  # wide experts on Hopper: faster (see there)
    if tiling is not None:
        return grouped_gemm_cutlass.grouped_mm(x_RD, w_EDO, offs_E, tiling)
    return F.grouped_mm(x_RD, w_EDO, offs=offs_E)


def _torch_wgrad(x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if x_RD.shape[0] == 0:
        return x_RD.new_zeros(offs_E.shape[0], x_RD.shape[1], dy_RO.shape[1])
    return F.grouped_mm(x_RD.t(), dy_RO, offs=offs_E)


def torch_grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> str | None:
    """``None`` when ``F.grouped_mm`` can run these shapes, else the reason it cannot."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no F.grouped_mm (needs torch >= 2.9)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return "F.grouped_mm needs a GPU of compute capability 8.0 or newer"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    bad = [d for d in dims if d % align]
    if bad:
        return f"F.grouped_mm needs widths divisible by {align} for {dtype}; got {bad}"
    return None


def resolve_gemm_backend(
    requested: str, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]
) -> tuple[GemmBackend, str | None]:
    """The backend to use and, when ``auto`` could not take the fastest one, why."""
    if requested == "grouped_gemm":
        from lightning_moe.ops.grouped_gemm_gg import require_grouped_gemm

        require_grouped_gemm()
        return "grouped_gemm", None
    if requested == "loop":
        return "loop", None
    reason = torch_grouped_mm_supported(device, dtype, dims)
    if reason is None:
        return "torch", None
    if requested == "torch":
        raise ValueError(f"experts_backend='torch' cannot run: {reason}; use experts_backend='auto' or 'loop'.")
    return "loop", reason


def _gg_gmm(x_RD: torch.Tensor, w_EDO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    from lightning_moe.ops.grouped_gemm_gg import gg_gmm

    return gg_gmm(x_RD, w_EDO, offs_E)


def _gg_wgrad(x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    from lightning_moe.ops.grouped_gemm_gg import gg_wgrad

    return gg_wgrad(x_RD, dy_RO, offs_E)


_FORWARD: dict[str, Callable[..., torch.Tensor]] = {"loop": grouped_mm_reference, "grouped_gemm": _gg_gmm}
_WGRAD: dict[str, Callable[..., torch.Tensor]] = {"loop": _wgrad_reference, "grouped_gemm": _gg_wgrad}


def gmm(
    x_RD: torch.Tensor,
    w_EDO: torch.Tensor,
    offs_E: torch.Tensor,
    backend: GemmBackend,
    gemm_kernel: str = "auto",
    gemm_tile: str = grouped_gemm_cutlass.DEFAULT_TILE,
) -> torch.Tensor:
    """Grouped ``x @ w[e]``; no autograd (the expert MLP owns the backward).

    ``gemm_kernel`` / ``gemm_tile``: the ``torch`` backend's choice between ``F.grouped_mm`` and the
    CUTLASS grouped GEMM (``grouped_gemm_cutlass.layer_tiling``); other backends ignore them."""
    if backend == "torch":
        return _torch_gmm(x_RD, w_EDO, offs_E, gemm_kernel, gemm_tile)
    return _FORWARD[backend](x_RD, w_EDO, offs_E)


def gmm_wgrad(x_RD: torch.Tensor, dy_RO: torch.Tensor, offs_E: torch.Tensor, backend: GemmBackend) -> torch.Tensor:
    """Per-expert ``x_e^T @ dy_e`` stacked to ``[E, D, O]`` (experts with no rows get zeros)."""
    if backend == "torch":
        return _torch_wgrad(x_RD, dy_RO, offs_E)
    return _WGRAD[backend](x_RD, dy_RO, offs_E)
