"""Which implementation each step of the FP8 experts runs: small pure functions of the settings.

Legend: T tokens, R rows grouped by expert.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["LocalRows", "WgradPrecision", "local_rows_plan", "resolve_wgrad_precision"]

WgradPrecision = Literal["fp8", "activation"]
LocalRows = Literal["gather_quantized_tokens", "permute_quantize", "quantize_moved_rows"]

_WGRAD_REQUESTS = ("auto", "fp8", "activation")


def resolve_wgrad_precision(requested: str, backend: str) -> WgradPrecision:
    """How the experts' weight-gradient GEMMs run (``Fp8Config.wgrad``) on a resolved GEMM backend.

    ``fp8``: both operands quantized in units along each expert's rows (``quantize_grouped_rows``),
    the DeepSeek-V3 recipe. ``activation``: the unquantized operands in the activation dtype through
    the bf16 experts' grouped weight-gradient GEMM (more precise). ``auto`` is ``fp8`` on ``emulate``
    (the reference numbers) and ``activation`` on the GPU backends: no FP8 grouped weight-gradient
    kernel there beats the bf16 one (H200: rowwise ``_scaled_grouped_mm`` 2.1 ms against 0.38 ms for
    bf16 at E=8, R=16384, K=4096, N=2048; blockwise runs one ``_scaled_mm`` per expert, with a host sync)."""
    if requested not in _WGRAD_REQUESTS:
        raise ValueError(f"Fp8Config.wgrad={requested!r} is not one of {_WGRAD_REQUESTS}")
    if requested == "auto":
        return "fp8" if backend == "emulate" else "activation"
    return requested  # type: ignore[return-value]


def local_rows_plan(recipe: str, save_fp8_activations: bool) -> LocalRows:
    """How the fused local path makes the FP8 rows ``q(x_RH)`` from the tokens ``x_TH``.

    * ``gather_quantized_tokens``: quantize the T tokens, gather their FP8 rows and scales (row
      units only); the T quantized tokens are what backward keeps, K times fewer bytes than R rows.
    * ``permute_quantize``: one fused gather + quantize of the R rows (row units, nothing kept in
      FP8: the rows are rebuilt from ``x_TH`` in backward).
    * ``quantize_moved_rows``: move the rows, then quantize them (tensorwise: one scale over the
      rows, which the tokens' scale would not equal)."""
    if recipe == "tensorwise":
        return "quantize_moved_rows"
    return "gather_quantized_tokens" if save_fp8_activations else "permute_quantize"
