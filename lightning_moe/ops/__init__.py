"""Kernels with a Python face; every op sits next to its torch reference.

Backend choice (``ops/backend.py``): the csrc kernels on CUDA when they build, the torch path
otherwise; ``LIGHTNING_MOE_KERNELS=auto|csrc|torch`` (a machine switch: is the JIT build wanted
here) forces one. The grouped_gemm package is imported only inside its adapter; the optional
CUTLASS kernels (`csrc/cutlass`, `ops/build_cutlass.py`) build only where their headers and an
sm_90 GPU are found. Which GEMM and weight-gradient kernels the experts run is the user's choice,
``KernelConfig`` (``lightning_moe/config.py``), read once when the layer is built and handed to the
ops as plain values; the weight-gradient kernels live in ``ops/wgrad/``. Environment variables the
package reads, all machine facts, each once per process and only in ``lightning_moe/resources.py``:
``LIGHTNING_MOE_KERNELS``, ``LIGHTNING_MOE_CACHE`` (build cache directory) and
``LIGHTNING_MOE_CUTLASS_DIR`` (CUTLASS headers).
"""

from lightning_moe.ops.expert_mlp import expert_swiglu_mlp, expert_swiglu_mlp_reference
from lightning_moe.ops.permute import (
    Permutation,
    build_permutation,
    build_permutation_reference,
    permute_rows,
    permute_rows_reference,
    unpermute_sum,
    unpermute_sum_reference,
)
from lightning_moe.ops.swiglu import weighted_swiglu, weighted_swiglu_reference

__all__ = [
    "Permutation",
    "build_permutation",
    "build_permutation_reference",
    "expert_swiglu_mlp",
    "expert_swiglu_mlp_reference",
    "permute_rows",
    "permute_rows_reference",
    "unpermute_sum",
    "unpermute_sum_reference",
    "weighted_swiglu",
    "weighted_swiglu_reference",
]
