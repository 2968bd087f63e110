"""Expert weight gradients added straight into an existing ``.grad`` (gradient-accumulation fusion).

Legend: R rows grouped by expert, D input width, O output width, E experts.

When a weight already has a gradient (gradient accumulation over micro-batches, or a loop that
never zeroes), autograd computes the new gradient into a fresh ``[E, D, O]`` buffer and then adds
it: write ``E*D*O`` values, read them and the old gradient, write the sum. For wide experts that
is tens of GB of memory traffic per step (DeepSeek-V3: 22.5 GB of expert gradients). Here the
weight-gradient GEMM of each expert runs with ``beta = 1`` into ``w.grad[e]`` itself
(``addmm_``): the old gradient is read once and written once, inside the GEMM's epilogue.

The backward then hands autograd no gradient for that weight, so this is only done when that is
exactly what the engine would have done (:func:`accumulation_target`): ``w`` is a leaf whose
``.grad`` is a plain tensor of its shape and dtype, the engine is running ``backward()`` (not
``autograd.grad``, not ``create_graph``) and would accumulate into ``w``, no hook is registered on
the tensor, and no CUDA graph is being captured. Hooks that others register on the gradient
accumulator node itself (``DistributedDataParallel``'s reducer, FSDP1) cannot be seen from
Python: that is why the feature is opt-in (``MoEConfig(fuse_wgrad_accumulation=True)``) and why
``MoELanguageModel`` refuses it under those strategies. One-process training and FSDP2 (which
keeps its unsharded parameters' ``.grad`` across accumulating micro-batches and reads it after
backward) work with it: ``tests/unit/test_wgrad_accumulation.py`` and, on 4 ranks,
``tests/dist/test_dist_fit.py::test_fused_expert_wgrad_accumulation_under_fsdp2_matches_one_process``.

Kernels (:class:`WgradFusion` picks one in the forward; ``LIGHTNING_MOE_WGRAD_KERNEL`` overrides).
Every cuBLAS one reads the row ranges from pinned host memory that the forward filled without
blocking (:class:`HostOffsets`), so the backward never drains the device queue:

* ``loop`` — one cuBLAS ``addmm_`` (beta = 1) per expert, in one stream.
* ``streams`` — the same GEMMs dealt round-robin over two streams. Hundreds of short GEMMs in one
  stream each leave a gap before the next; two in flight fill them. H200, DeepSeek-V3 (256
  experts): w13 14.5 -> 12.5 ms, the layer 50.5 -> 47.4 ms (``benchmarks/wgrad_kernels.py``,
  ``benchmarks/moe_layer.py``); Mixtral (8 experts, long GEMMs): slower (w13 12.47 vs 11.93 ms), hence ``auto``.
* ``cutlass`` (sm_90, CUTLASS headers installed: ``ops/wgrad_cutlass.py``) — one persistent,
  warp-specialised grouped GEMM with a beta = 1 epilogue, row ranges read on the device: one
  launch per weight, no host sync, no per-expert memset.
* ``auto`` (default) — ``cutlass`` for narrow experts where it is available (the per-expert GEMMs
  do not pay there: :func:`fusion_pays`); otherwise ``streams`` on CUDA from 16 experts on, else
  ``loop``. Measured in one process on the H200 (``benchmarks/moe_layer.py --fuse-wgrad
  --fuse-wgrad-kernels streams``): Qwen3-30B-A3B 8.75 ms with ``cutlass`` vs 9.27 unfused;
  DeepSeek-V3 47.05 ms with ``streams`` vs 48.75 with ``cutlass``: inside the step the loop's
  GEMMs take 18.2 ms for both weights and CUTLASS 20.0 (``benchmarks/wgrad_in_layer.py``; alone,
  started from an idle device, the loop is paced by its host launches and looks slower); Mixtral a tie.
  ``LIGHTNING_MOE_WGRAD_STREAMS`` sets the stream count, for both weights (``3``) or each (``w13=3,w2=1``).
* ``triton`` (CUDA, Triton importable) — one grouped Triton kernel that reads the row ranges from
  the device offsets (``ops/wgrad_triton.py``): one launch, no host sync, but on the H200 no
  faster than the loop for any tile tried (DeepSeek-V3: 22.3 vs 22.6 ms for both weights, layer
  53.3 ms), so opt-in.

Measured and dropped: one strided-batched GEMM over rows padded to the largest expert (no faster,
+1.3 GiB), cuBLASLt instead of cuBLAS (same kernels and per-GEMM memsets; layer 48.1 vs 47.0 ms),
the transposed product (same), running them on side streams beside the data-gradient GEMM
(DeepSeek-V3 layer 46.66 vs 46.67 ms, +0.8 GiB activation peak).
"""

from __future__ import annotations

import os

import torch
from torch.autograd.graph import get_gradient_edge

from lightning_moe.ops import wgrad_cutlass, wgrad_triton

__all__ = [
    "WGRAD_KERNELS",
    "HostOffsets",
    "WgradFusion",
    "accumulate_wgrad_",
    "accumulation_target",
    "fresh_wgrad_tiling",
    "fusion_pays",
    "wide_experts",
    "wgrad_streams",
    "wgrad_kernel",
]

# Below this many bytes of one expert's weights (w13 + w2), one GEMM launch per expert costs more
# host time than the device time it saves: the grouped GEMM and autograd's addition stay.
_MIN_EXPERT_WEIGHT_BYTES = 32 << 20


def fusion_pays(hidden_size: int, ffn_hidden_size: int, element_size: int) -> bool:
    """Whether per-expert accumulating GEMMs beat one grouped GEMM plus an addition for this shape.

    DeepSeek-V3 (88 MB per expert in bf16) and Mixtral (352 MB) do; Qwen3-30B-A3B (9.4 MB,
    128 small GEMMs per projection) does not.
    """
    return 3 * hidden_size * ffn_hidden_size * element_size >= _MIN_EXPERT_WEIGHT_BYTES


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


WGRAD_KERNELS = ("auto", "loop", "streams", "triton", "cutlass")


def wide_experts(w2: torch.Tensor) -> bool:
    """Whether the experts (down-projection ``[E, F, H]``) are wide enough for per-expert GEMMs to pay."""
    return fusion_pays(w2.shape[-1], w2.shape[-2], w2.element_size())


def fresh_wgrad_tiling(x_RD: torch.Tensor, dy_RO: torch.Tensor) -> str | None:
    """The CUTLASS tiling for a fresh ``[E, D, O]`` weight gradient (``.grad`` is ``None``), or ``None``
    for ``F.grouped_mm``: CUTLASS (beta = 0) only when ``LIGHTNING_MOE_WGRAD_KERNEL=cutlass`` asks for it.

    ``auto`` keeps ``F.grouped_mm``: inside the layer step on the H200 (``benchmarks/layer_arms.py``,
    fresh gradients, a001889) the CUTLASS kernel was slower on both shapes measured: Qwen3-30B-A3B
    8.22 vs 8.08 ms a step, DeepSeek-V3 42.38 vs 41.81. Its edge over cuBLAS is the accumulation
    fused into its epilogue, which a fresh gradient does not need.
    """
    if wgrad_kernel() != "cutlass" or not x_RD.is_cuda or dy_RO.dtype != x_RD.dtype:
        return None
    if x_RD.shape[1] % 8 or dy_RO.shape[1] % 8 or not wgrad_cutlass.supported(x_RD):
        return None
    return wgrad_cutlass.tile()


# From this many experts on, the default deals them over two streams: hundreds of short GEMMs in
# one stream leave a gap between each pair (DeepSeek-V3's 256 experts: 3 ms a step on the H200).
_STREAMS_FROM_EXPERTS = 16


def wgrad_kernel() -> str:
    """``LIGHTNING_MOE_WGRAD_KERNEL``: ``auto`` (default), ``loop``, ``streams``, ``triton`` or ``cutlass``."""
    kernel = os.environ.get("LIGHTNING_MOE_WGRAD_KERNEL", "auto").lower()
    if kernel not in WGRAD_KERNELS:
        raise ValueError(f"LIGHTNING_MOE_WGRAD_KERNEL={kernel!r} is unknown; choose one of {WGRAD_KERNELS}.")
    return kernel


def auto_kernel(num_experts: int) -> str:
    """What ``auto`` runs on CUDA: two streams for many experts, else one."""
    return "streams" if num_experts >= _STREAMS_FROM_EXPERTS else "loop"


# Streams per weight of the ``streams`` kernel: the up-projection (w13) and the down-projection (w2).
_DEFAULT_STREAMS = {"w13": 2, "w2": 2}


def wgrad_streams(weight: str) -> int:
    """Streams the ``streams`` kernel deals ``weight``'s experts over (``"w13"`` or ``"w2"``).

    ``LIGHTNING_MOE_WGRAD_STREAMS`` overrides: one count for both (``3``) or one per weight
    (``w13=3,w2=1``).
    """
    counts = dict(_DEFAULT_STREAMS)
    raw = os.environ.get("LIGHTNING_MOE_WGRAD_STREAMS", "").replace(" ", "")
    if raw:
        try:
            if "=" in raw:
                for part in raw.split(","):
                    name, _, value = part.partition("=")
                    if name not in counts:
                        raise ValueError(name)
                    counts[name] = int(value)
            else:
                counts = {name: int(raw) for name in counts}
        except ValueError:
            raise ValueError(
                f"LIGHTNING_MOE_WGRAD_STREAMS={raw!r} is not understood; give one count (e.g. 2) or one per "
                "weight (e.g. w13=3,w2=1)."
            ) from None
        if min(counts.values()) < 1:
            raise ValueError(f"LIGHTNING_MOE_WGRAD_STREAMS={raw!r}: every stream count must be at least 1.")
    return counts[weight]


class WgradFusion:
    """What one layer call needs to accumulate its weight gradients in place in backward."""

    def __init__(self, offs_E: torch.Tensor, x: torch.Tensor, weights: tuple[torch.Tensor, ...] = ()) -> None:
        self.offs_E = offs_E
        kernel = wgrad_kernel()
        if kernel == "cutlass" or (kernel == "auto" and weights and not wide_experts(weights[-1])):
            kernel = "cutlass" if wgrad_cutlass.supported(x, *weights) else auto_kernel(offs_E.numel())
        elif kernel == "auto":
            kernel = auto_kernel(offs_E.numel())
        if (kernel == "triton" and not wgrad_triton.supported(x)) or (kernel == "streams" and not x.is_cuda):
            kernel = "loop"
        self.kernel = kernel
        self.cutlass_tile = wgrad_cutlass.tile() if kernel == "cutlass" else None  # the tiling, chosen once
        self.host: HostOffsets | None = None  # copy_offsets(), once the forward's first GEMM is launched

    def copy_offsets(self) -> None:
        """Start the host copy of the row offsets the cuBLAS kernels need in backward (not for Triton/CUTLASS)."""
        if not self.grouped and self.host is None:
            self.host = HostOffsets(self.offs_E)

    @property
    def grouped(self) -> bool:
        """One grouped launch that reads the row ranges on the device (no host offsets needed)."""
        return self.kernel in ("triton", "cutlass")

    def accumulate_(self, grad_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, weight: str) -> None:
        """``grad_EDO[e] += x_e^T dy_e``; ``weight`` (``"w13"``/``"w2"``) picks the stream count."""
        if self.kernel == "cutlass":
            wgrad_cutlass.grouped_wgrad_accumulate_(grad_EDO, x_RD, dy_RO, self.offs_E, self.cutlass_tile)
            return
        if self.kernel == "triton":
            wgrad_triton.grouped_wgrad_accumulate_(grad_EDO, x_RD, dy_RO, self.offs_E)
            return
        self.copy_offsets()  # normally done in the forward already
        streams = wgrad_streams(weight) if self.kernel == "streams" else 1
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


def accumulate_wgrad_(
    grad_EDO: torch.Tensor, x_RD: torch.Tensor, dy_RO: torch.Tensor, bounds: list[int], streams: int = 1
) -> None:
    """``grad_EDO[e] += x_e^T @ dy_e`` for every expert with rows, one GEMM with ``beta = 1`` each.

    The per-expert views come from one ``split`` / ``unbind`` each, so the host loop only launches
    GEMMs: with hundreds of experts it is the host, not the device, that sets the pace otherwise.

    ``streams > 1`` (CUDA): experts are dealt round-robin over that many streams; a GEMM in flight
    on another stream fills the gap each short GEMM leaves before the next. Each stream's GEMMs are
    launched together: switching the stream per expert doubles the host time of a launch (the
    cuBLAS handle is re-bound to the stream each time), and with hundreds of experts the host then
    sets the pace (H200, Qwen3-30B-A3B w13: 6.0 ms round-robin, 3.5 ms lane by lane). The current
    stream waits for the side streams before returning, so everything after (and any reuse of these
    tensors' memory, which happens on the current stream) is ordered after all of them.
    """
    if streams < 1:
        raise ValueError(f"accumulate_wgrad_ needs streams >= 1; got {streams}.")
    counts = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    xs_DR = x_RD[: bounds[-1]].t().split(counts, dim=1)
    dys_RO = dy_RO[: bounds[-1]].split(counts, dim=0)
    work = [(g, x, dy) for g, x, dy, rows in zip(grad_EDO.unbind(0), xs_DR, dys_RO, counts) if rows]
    if streams == 1 or not x_RD.is_cuda:  # streams are CUDA's: elsewhere the loop runs in one
        for grad_DO, x_DR, dy_RO_e in work:
            grad_DO.addmm_(x_DR, dy_RO_e)
        return
    main = torch.cuda.current_stream(x_RD.device)
    lanes = [main] + [_side_stream(x_RD.device, i) for i in range(streams - 1)]
    for side in lanes[1:]:
        side.wait_stream(main)
    for index, lane in enumerate(lanes):  # lane by lane: one stream switch per lane, not per expert
        with torch.cuda.stream(lane):
            for grad_DO, x_DR, dy_RO_e in work[index::streams]:
                grad_DO.addmm_(x_DR, dy_RO_e)
    for side in lanes[1:]:
        main.wait_stream(side)


_SIDE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    if (device, index) not in _SIDE_STREAMS:
        _SIDE_STREAMS[device, index] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device, index]
