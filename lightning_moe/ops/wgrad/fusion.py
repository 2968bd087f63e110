"""What one layer call needs to add its expert weight gradients into ``.grad`` in backward.

Legend: R rows grouped by expert, D input width, O output width, E experts.

:class:`WgradFusion` is built in the forward with the kernel chosen for this call
(``choice.fusion_kernel``) and the row offsets; :func:`accumulation_target` says, in backward,
whether the engine would have added into ``w.grad`` itself (only then is the in-place path taken).
The package docstring (``ops/wgrad/__init__.py``) explains when that is safe and what it saves.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from lightning_moe.ops.wgrad import cutlass_kernel
from lightning_moe.ops.wgrad.choice import fusion_kernel
from lightning_moe.ops.wgrad.cublas_loop import accumulate_wgrad_

__all__ = ["HostOffsets", "WgradFusion", "accumulation_target"]


class HostOffsets:
    """``offs_E`` (inclusive row counts, on the device) copied to the host behind the device queue."""

    def __init__(self, offs_E: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._bounds: list[int] | None = None
        if offs_E.is_cuda:
            self._host = torch.empty(offs_E.shape, dtype=offs_E.dtype, pin_memory=True)
            self._host.copy_(offs_E, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = offs_E.clone()

    def bounds(self) -> list[int]:
        """``[0, end of expert 0, end of expert 1, ...]``; waits only for the forward's copy.

        Read once and kept: both weights of the layer call use the same bounds."""
        if self._bounds is None:
            if self._event is not None:
                self._event.synchronize()  # SYNC: on the forward's copy only, long done by backward
            self._bounds = [0] + self._host.tolist()
        return self._bounds


class WgradFusion:
    """What one layer call needs to accumulate its weight gradients in place in backward."""

    def __init__(
        self,
        offs_E: torch.Tensor,
        x: torch.Tensor,
        weights: tuple[torch.Tensor, ...] = (),
        kernel: str = "auto",
        streams: tuple[int, int] = (2, 2),
    ) -> None:
        """``kernel``: the requested one (``KernelConfig.wgrad``); ``streams``: the stream counts of
        the ``streams`` kernel for ``w13`` and ``w2``."""
        if len(streams) != 2 or min(streams) < 1:
            raise ValueError(f"WgradFusion: streams={streams!r} must be two counts >= 1 (w13, w2); fix them.")
        self.offs_E = offs_E
        self.kernel = fusion_kernel(kernel, offs_E, x, weights)
        self.streams = {"w13": streams[0], "w2": streams[1]}
        self.host: HostOffsets | None = None  # copy_offsets(), once the forward's first GEMM is launched

    def copy_offsets(self) -> None:
        """Start the host copy of the row offsets the cuBLAS kernels need in backward (not for CUTLASS)."""
        if not self.grouped and self.host is None:
            self.host = HostOffsets(self.offs_E)

    @property
    def grouped(self) -> bool:
        """One grouped launch that reads the row ranges on the device (no host offsets needed)."""
        return self.kernel == "cutlass"

    def accumulate_(self, grad_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, weight: str) -> None:
        """``grad_EDO[e] += x_e^T dy_e``; ``weight`` (``"w13"``/``"w2"``) picks the stream count."""
        if self.kernel == "cutlass":
            cutlass_kernel.grouped_wgrad_accumulate_(grad_EDO, x_RD, dy_RO, self.offs_E)
            return
        self.copy_offsets()  # normally done in the forward already
        streams = self.streams[weight] if self.kernel == "streams" else 1
        accumulate_wgrad_(grad_EDO, x_RD, dy_RO, self.host.bounds(), streams=streams)


def accumulation_target(w: torch.Tensor) -> torch.Tensor | None:
    """``w.grad`` when the engine would add ``w``'s gradient into it in place and nothing else
    would see the gradient on the way; else ``None`` (the caller returns the gradient instead)."""
    if not (w.is_leaf and w.requires_grad) or torch.is_grad_enabled():  # grad mode: create_graph
        return None
    grad = w.grad
    if (
        type(grad) is not torch.Tensor
        or grad.shape != w.shape
        or grad.dtype != w.dtype
        or grad.device != w.device
        or grad.requires_grad
        or not grad.is_contiguous()
    ):
        return None
    if w._backward_hooks or getattr(w, "_post_accumulate_grad_hooks", None):
        return None
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    try:
        will_accumulate = torch._C._will_engine_execute_node(get_gradient_edge(w).node)
    except RuntimeError:  # autograd.grad() asked for this leaf: it is captured, not accumulated
        return None
    return grad if will_accumulate else None
