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

Kernels (``KernelConfig.wgrad``, read when the layer is built; :func:`choice.fusion_kernel` resolves
``auto`` per layer call from the shapes). One file per backend, one for the choice:
``cublas_loop.py``, ``cutlass_kernel.py``, ``choice.py``; ``fusion.py`` holds
what one layer call needs (:class:`WgradFusion`) and when the in-place path is safe.
Every cuBLAS one reads the row ranges from pinned host memory that the forward filled without
blocking (:class:`HostOffsets`), so the backward never drains the device queue:

* ``loop`` — one cuBLAS ``addmm_`` (beta = 1) per expert, in one stream.
* ``streams`` — the same GEMMs dealt round-robin over two streams. Hundreds of short GEMMs in one
  stream each leave a gap before the next; two in flight fill them. H200, DeepSeek-V3 (256
  experts): w13 14.5 -> 12.5 ms, the layer 50.5 -> 47.4 ms (``benchmarks/probes/wgrad_kernels.py``,
  ``benchmarks/moe_layer.py``); Mixtral (8 experts, long GEMMs): slower (w13 12.47 vs 11.93 ms), hence ``auto``.
* ``cutlass`` (sm_90, CUTLASS headers installed: ``cutlass_kernel.py``) — one persistent,
  warp-specialised grouped GEMM with a beta = 1 epilogue, row ranges read on the device: one
  launch per weight, no host sync, no per-expert memset.
* ``auto`` (default) — ``cutlass`` for narrow experts where it is available (the per-expert GEMMs
  do not pay there: :func:`fusion_pays`); otherwise ``streams`` on CUDA from 16 experts on, else
  ``loop``. Measured in one process on the H200 (``benchmarks/moe_layer.py --fuse-wgrad
  --fuse-wgrad-kernels streams``): Qwen3-30B-A3B 8.75 ms with ``cutlass`` vs 9.27 unfused;
  DeepSeek-V3 47.05 ms with ``streams`` vs 48.75 with ``cutlass``: inside the step the loop's
  GEMMs take 18.2 ms for both weights and CUTLASS 20.0 (``benchmarks/probes/wgrad_in_layer.py``; alone,
  started from an idle device, the loop is paced by its host launches and looks slower); Mixtral a tie.
  ``KernelConfig(wgrad_streams_w13=..., wgrad_streams_w2=...)`` sets the stream counts (2 each).

Fresh gradients (``.grad`` is ``None``) are not this package's business: ``F.grouped_mm`` writes
them (``ops/grouped_gemm.gmm_wgrad``).

Measured and dropped: a grouped Triton kernel reading the row ranges on the device (one launch, no
host sync; on the H200 DeepSeek-V3 22.3 ms for both weights against 22.6 for the one-stream loop and
~19 for two streams, Qwen3-30B-A3B 2.64 against 2.16 for CUTLASS), the CUTLASS kernel writing fresh
gradients with beta = 0 (slower than ``F.grouped_mm`` inside the step: Qwen3-30B-A3B 8.22 vs 8.08 ms,
DeepSeek-V3 42.38 vs 41.81), one strided-batched GEMM over rows padded to the largest expert (no faster,
+1.3 GiB), cuBLASLt instead of cuBLAS (same kernels and per-GEMM memsets; layer 48.1 vs 47.0 ms),
the transposed product (same), running them on side streams beside the data-gradient GEMM
(DeepSeek-V3 layer 46.66 vs 46.67 ms, +0.8 GiB activation peak).
"""

from lightning_moe.ops.wgrad.choice import (
    WGRAD_KERNELS,
    auto_kernel,
    fusion_kernel,
    fusion_pays,
    may_fuse,
    wide_experts,
)
from lightning_moe.ops.wgrad.cublas_loop import accumulate_wgrad_
from lightning_moe.ops.wgrad.fusion import HostOffsets, WgradFusion, accumulation_target

__all__ = [
    "WGRAD_KERNELS",
    "HostOffsets",
    "WgradFusion",
    "accumulate_wgrad_",
    "accumulation_target",
    "auto_kernel",
    "fusion_kernel",
    "fusion_pays",
    "may_fuse",
    "wide_experts",
]
