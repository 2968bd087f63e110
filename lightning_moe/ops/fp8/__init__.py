"""FP8 training ops: scaling recipes, quantization, and FP8 GEMMs.

Legend: M rows, K contracted width, N output width, E experts, R rows sorted by expert.

* ``recipe.py``: the recipes (tensorwise, rowwise, blockwise 1x128 / 128x128), formats (e4m3,
  e5m2), the scale convention (fp32 dequantization scales, ``x ~= data.float() * scale``) and the
  non-finite rule (a unit holding NaN/inf dequantizes to NaN throughout).
* ``quantize.py``: ``Fp8Tensor`` (data + scales), ``quantize``, ``quantize_grouped_rows`` (units
  inside expert segments, for weight gradients), ``fake_quantize``.
* ``gemm.py``: ``fp8_mm``, ``fp8_grouped_mm``, ``fp8_grouped_wgrad`` on the ``emulate`` backend
  (dequantize, fp32 matmul: the math every backend equals) and ``torch`` (``torch._scaled_mm`` /
  ``torch._scaled_grouped_mm`` on sm_89+) and ``cutlass`` (blockwise); ``resolve_fp8_backend`` picks one.
* ``kernels.py``: the csrc row quantization kernels and the CUTLASS blockwise grouped GEMM.
* ``expert_mlp.py``: the FP8 experts (forward and backward); ``choice.py``: its small selection
  rules; ``weight_cache.py``: the expert weights quantized once per weight version.
"""

from lightning_moe.ops.fp8.gemm import Fp8GemmBackend, fp8_grouped_mm, fp8_grouped_wgrad, fp8_mm, resolve_fp8_backend
from lightning_moe.ops.fp8.quantize import Fp8Tensor, fake_quantize, quantize, quantize_grouped_rows
from lightning_moe.ops.fp8.recipe import BLOCK, FP8_DTYPE, FP8_MAX, Fp8Format, Fp8Recipe

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Format",
    "Fp8GemmBackend",
    "Fp8Recipe",
    "Fp8Tensor",
    "fake_quantize",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8_mm",
    "quantize",
    "quantize_grouped_rows",
    "resolve_fp8_backend",
]
