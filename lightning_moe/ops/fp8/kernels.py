"""FP8 kernels: row quantization (plain, fused into a permutation, fused into the SwiGLU) and the
CUTLASS blockwise-scaled FP8 grouped GEMM, each with its torch reference as the fallback.

Legend: R rows, S source rows a permutation gathers from, H row width, F expert FFN width, K the
contracted width, N output width, E experts, U scale units per row (1 rowwise, ceil(H/128)
blockwise), Kb = ceil(K/128), Nb = ceil(N/128).

Row quantization (``csrc/fp8_quant.cu``, in ``torch.ops.lightning_moe_C``): rowwise or blockwise
``(1, 128)`` units along the last dim of ``[R, H]`` rows (fp32, bf16 or fp16 in), e4m3 or e5m2, with
the scales, rounding and non-finite rule of ``quantize.py`` (``recipe.py`` states them). The kernels
equal the torch references bit for bit in the data and exactly in the scales (tests/gpu).

* :func:`quantize_rows_fp8`: ``quantize(x_RH, recipe, fmt, reduce_dim=-1)``.
* :func:`permute_quantize`: ``quantize(x_SH[src_idx_R])`` (``-1``: a zero row, scale 1) in one read of
  x and one write of FP8: the send buffer of an FP8 token dispatch.
* :func:`swiglu_quantize`: ``quantize(weighted_swiglu_forward(h_R2F, w_R))``: the SwiGLU values (as
  the csrc SwiGLU kernel computes and rounds them to h's dtype) written directly as FP8, the input of
  the second expert GEMM.

Each runs its csrc kernel for CUDA tensors when the extension builds (``ops/build.py``;
``LIGHTNING_MOE_KERNELS=torch`` forces the references) and the torch reference otherwise
(CPU, or the tensorwise recipe, whose one scale per tensor is not a row unit). No autograd: the
callers' autograd functions own the gradients.

The GEMM (``csrc/cutlass/fp8_blockwise_grouped*``, in ``torch.ops.lightning_moe_cutlass_C``, sm_90
only, optional like every CUTLASS kernel here: ``ops/build_cutlass.py``):
:func:`cutlass_blockwise_grouped_mm` is the ``cutlass`` backend of ``gemm.fp8_grouped_mm`` for the
blockwise recipe: ``out_RN[lo:hi] = a[lo:hi] @ b[e]`` with ``a`` in 1 x 128 tiles and ``b`` in
128 x 128 tiles, the per-tile scales applied to fp32 partial sums after every 128-wide K step
(DeepSeek-V3's recipe), bf16 out, rows past ``offs_E[-1]`` zero. :func:`cutlass_blockwise_supported`
says whether it applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_moe.ops.backend import csrc_extension
from lightning_moe.ops.fp8.quantize import Fp8Tensor, quantize
from lightning_moe.ops.fp8.recipe import BLOCK, FP8_DTYPE, Fp8Format, Fp8Recipe, check_format, check_recipe

__all__ = [
    "cutlass_blockwise_available",
    "cutlass_blockwise_grouped_mm",
    "cutlass_blockwise_supported",
    "cutlass_blockwise_takes",
    "permute_quantize",
    "permute_quantize_reference",
    "quantize_rows_fp8",
    "swiglu_quantize",
    "swiglu_quantize_reference",
]

_ROW_TILE = (1, BLOCK)
_WEIGHT_TILE = (BLOCK, BLOCK)
_ALIGN = 16  # K and N of the CUTLASS GEMM: 16 bytes of FP8 per TMA row


# ---- row quantization -----------------------------------------------------------------------------


def _check_rows(t: object, name: str, shape: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D {shape}, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16 to quantize, got {t.dtype}")
    return t


def _result(data: torch.Tensor, scale: torch.Tensor, recipe: str, fmt: str) -> Fp8Tensor:
    tile = _ROW_TILE if recipe == "blockwise" else None
    return Fp8Tensor(data, scale, recipe, fmt, -1, tile)  # type: ignore[arg-type]


def _row_kernels(t: torch.Tensor, recipe: str):
    """The csrc extension when ``t``'s rows can be quantized by it (row units on CUDA), else ``None``."""
    if recipe == "tensorwise" or t.numel() == 0:
        return None
    return csrc_extension(t)


def quantize_rows_fp8(
    x_RH: torch.Tensor, recipe: Fp8Recipe, fmt: Fp8Format = "e4m3", *, pow2_scales: bool = False
) -> Fp8Tensor:
    """``quantize(x_RH, recipe, fmt, reduce_dim=-1, pow2_scales=...)`` by the csrc kernel on CUDA.

    Rowwise: scale ``[R, 1]``; blockwise: ``(1, 128)`` tiles, scale ``[R, ceil(H/128)]``."""
    recipe, fmt = check_recipe(recipe), check_format(fmt)
    x_RH = _check_rows(x_RH, "x_RH", "[R, H]")
    ext = _row_kernels(x_RH, recipe)
    if ext is None:
        return quantize(x_RH.detach(), recipe, fmt, reduce_dim=-1, pow2_scales=pow2_scales)
    data, scale = ext.quantize_rows_fp8(x_RH.detach().contiguous(), None, fmt, recipe == "blockwise", pow2_scales)
    return _result(data, scale, recipe, fmt)


def _check_index(src_idx_R: object, S: int) -> torch.Tensor:
    if not isinstance(src_idx_R, torch.Tensor) or src_idx_R.dim() != 1 or src_idx_R.is_floating_point():
        raise TypeError(
            f"src_idx_R must be a 1-D integer tensor [R] of source rows (-1: a zero row), got {src_idx_R!r}"
        )
    if S > torch.iinfo(torch.int32).max:
        raise ValueError(f"x_SH has {S} rows; int32 row indices address at most {torch.iinfo(torch.int32).max}")
    return src_idx_R


def permute_quantize_reference(
    x_SH: torch.Tensor,
    src_idx_R: torch.Tensor,
    recipe: Fp8Recipe,
    fmt: Fp8Format = "e4m3",
    *,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """The spec of :func:`permute_quantize`: gather (``-1``: zeros), then ``quantize``."""
    idx = src_idx_R.to(x_SH.device).long()
    if x_SH.shape[0] == 0:  # nothing to gather: every row is a zero row
        rows = x_SH.new_zeros(idx.shape[0], x_SH.shape[1])
    else:
        rows = x_SH[idx.clamp_min(0)]
        rows = torch.where((idx < 0)[:, None], torch.zeros((), dtype=rows.dtype, device=rows.device), rows)
    return quantize(rows.detach(), recipe, fmt, reduce_dim=-1, pow2_scales=pow2_scales)


def permute_quantize(
    x_SH: torch.Tensor,
    src_idx_R: torch.Tensor,
    recipe: Fp8Recipe,
    fmt: Fp8Format = "e4m3",
    *,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """Rows ``x_SH[src_idx_R[r]]`` (``-1``: a zero row) quantized along H, in one pass over x.

    The device never checks ``src_idx_R < S`` beyond a device assert: pass a valid permutation."""
    recipe, fmt = check_recipe(recipe), check_format(fmt)
    x_SH = _check_rows(x_SH, "x_SH", "[S, H]")
    src_idx_R = _check_index(src_idx_R, x_SH.shape[0])
    ext = _row_kernels(x_SH, recipe)
    if ext is None:
        return permute_quantize_reference(x_SH, src_idx_R, recipe, fmt, pow2_scales=pow2_scales)
    idx = src_idx_R.to(device=x_SH.device, dtype=torch.int32).contiguous()
    data, scale = ext.quantize_rows_fp8(x_SH.detach().contiguous(), idx, fmt, recipe == "blockwise", pow2_scales)
    return _result(data, scale, recipe, fmt)


def _check_swiglu(h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> None:
    _check_rows(h_R2F, "h_R2F", "[R, 2F]")
    if h_R2F.shape[1] % 2:
        raise ValueError(f"h_R2F has {h_R2F.shape[1]} columns; expected an even 2F = [gate | up]")
    if w_R is not None and (not isinstance(w_R, torch.Tensor) or w_R.shape != (h_R2F.shape[0],)):
        raise ValueError(f"w_R must be a tensor [R] = [{h_R2F.shape[0]}] of row weights or None, got {w_R!r}")


def swiglu_quantize_reference(
    h_R2F: torch.Tensor,
    w_R: torch.Tensor | None = None,
    recipe: Fp8Recipe = "blockwise",
    fmt: Fp8Format = "e4m3",
    *,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """The spec of :func:`swiglu_quantize`: the weighted SwiGLU in h's dtype, then ``quantize``."""
    from lightning_moe.ops.swiglu import weighted_swiglu_forward

    a_RF = weighted_swiglu_forward(h_R2F.detach(), None if w_R is None else w_R.detach().float())
    return quantize(a_RF, recipe, fmt, reduce_dim=-1, pow2_scales=pow2_scales)


def swiglu_quantize(
    h_R2F: torch.Tensor,
    w_R: torch.Tensor | None = None,
    recipe: Fp8Recipe = "blockwise",
    fmt: Fp8Format = "e4m3",
    *,
    pow2_scales: bool = False,
) -> Fp8Tensor:
    """``a_RF = silu(gate) * up * w_R`` of ``h_R2F = [gate | up]``, written directly as FP8 with its scales.

    Equals :func:`swiglu_quantize_reference` bit for bit on CUDA (the csrc SwiGLU's values, rounded to
    h's dtype, quantized as ``quantize`` does); ``a`` itself is never stored."""
    recipe, fmt = check_recipe(recipe), check_format(fmt)
    _check_swiglu(h_R2F, w_R)
    ext = _row_kernels(h_R2F, recipe)
    if ext is None:
        return swiglu_quantize_reference(h_R2F, w_R, recipe, fmt, pow2_scales=pow2_scales)
    w = None if w_R is None else w_R.detach().to(device=h_R2F.device, dtype=torch.float32).contiguous()
    data, scale = ext.swiglu_quantize_fp8(h_R2F.detach().contiguous(), w, fmt, recipe == "blockwise", pow2_scales)
    return _result(data, scale, recipe, fmt)


# ---- the CUTLASS blockwise grouped GEMM ------------------------------------------------------------


def _cutlass_ops():
    from lightning_moe.ops.build_cutlass import load_cutlass_extension

    ops = load_cutlass_extension()
    return ops if ops is not None and hasattr(ops, "fp8_blockwise_grouped_mm") else None


def _blockwise_operands_ok(a: Fp8Tensor, b: Fp8Tensor) -> str | None:
    """Why ``a @ b[e]`` is not a blockwise e4m3 grouped GEMM the kernel takes, or ``None``."""
    if not isinstance(a, Fp8Tensor) or not isinstance(b, Fp8Tensor):
        return "a and b must be Fp8Tensor"
    if a.recipe != "blockwise" or b.recipe != "blockwise":
        return f"the kernel takes the blockwise recipe; got a {a.recipe!r}, b {b.recipe!r}"
    if a.fmt != "e4m3" or b.fmt != "e4m3":
        return f"the kernel takes e4m3 operands; got a {a.fmt!r}, b {b.fmt!r}"
    if a.grouped or a.data.dim() != 2 or a.reduce_dim != -1 or a.tile != _ROW_TILE:
        return f"a must be 2-D [R, K] rows in (1, 128) tiles along K; got shape {tuple(a.shape)}, tile {a.tile}"
    if b.data.dim() != 3 or b.reduce_dim != -2 or b.tile != _WEIGHT_TILE:
        return (
            f"b must be [E, K, N] weights in (128, 128) tiles contracted over K; got shape {tuple(b.shape)}, "
            f"tile {b.tile}"
        )
    if a.shape[1] != b.shape[1]:
        return f"a has K={a.shape[1]} but b has K={b.shape[1]}"
    if a.shape[1] == 0 or b.shape[2] == 0:
        return "K and N must be positive"
    return None


def cutlass_blockwise_takes(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel's contract admits these operands (shapes, recipe, formats, bf16 out, CUDA);
    the build is not asked."""
    if _blockwise_operands_ok(a, b) is not None or out_dtype != torch.bfloat16:
        return False
    return a.data.is_cuda and a.device == b.device


def cutlass_blockwise_available() -> bool:
    """Whether the CUTLASS FP8 grouped GEMM is built and loaded here (builds it on first call)."""
    return _cutlass_ops() is not None


def cutlass_blockwise_supported(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`cutlass_blockwise_grouped_mm` runs these operands here (cheap checks, the build last)."""
    return cutlass_blockwise_takes(a, b, out_dtype) and cutlass_blockwise_available()


def _pad_last(t: torch.Tensor, to: int) -> torch.Tensor:
    """``t`` with its last dim zero-padded to a multiple of ``to`` (FP8 padded as bytes: 0x00 is +0)."""
    pad = -t.shape[-1] % to
    if pad == 0:
        return t
    raw = t.view(torch.uint8) if t.dtype in FP8_DTYPE.values() else t
    out = F.pad(raw, (0, pad))
    return out.view(t.dtype) if raw is not t else out


def cutlass_blockwise_grouped_mm(
    a: Fp8Tensor, b: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``out_RN[lo:hi] = a[lo:hi] @ b[e]`` per expert with blockwise scales (the CUTLASS sm_90 kernel).

    ``a``: ``[R, K]`` e4m3 in (1, 128) tiles; ``b``: ``[E, K, N]`` e4m3 in (128, 128) tiles; ``offs_E``:
    inclusive row ends (int, device). Out: ``[R, N]`` bf16, rows from ``offs_E[-1]`` on zero. K or N
    not a multiple of 16 are padded with zeros here (the scale grids are unchanged: 16 divides 128)
    and the output is sliced back. ``b``'s data is read K-major: a ``b`` that is the ``transpose()``
    of an ``[E, N, K]`` quantization already is; an N-major one is copied once to K-major here."""
    why = _blockwise_operands_ok(a, b)
    if why is not None:
        raise ValueError(f"cutlass_blockwise_grouped_mm: {why}")
    if out_dtype != torch.bfloat16:
        raise ValueError(
            f"cutlass_blockwise_grouped_mm writes bfloat16; out_dtype={out_dtype} is not available "
            "(use backend='emulate' or 'torch' for other output dtypes)"
        )
    if not isinstance(offs_E, torch.Tensor) or offs_E.dim() != 1 or offs_E.shape[0] != b.shape[0]:
        raise ValueError(f"offs_E must be a 1-D tensor [E] = [{b.shape[0]}] of inclusive row ends, got {offs_E!r}")
    ops = _cutlass_ops()
    if ops is None:
        raise RuntimeError(
            "cutlass_blockwise_grouped_mm: the CUTLASS kernels are unavailable here; check "
            "cutlass_blockwise_supported() first (needs an sm_90 GPU and the CUTLASS headers)."
        )
    R, K = a.shape
    E, _, N = b.shape
    a_data = _pad_last(a.data.contiguous(), _ALIGN)
    b_EKN = b.data if N % _ALIGN == 0 else _pad_last(b.data.contiguous(), _ALIGN)  # N padded (rare shapes)
    # K-major: [E, N, K] in memory, seen as [E, K, N] (.contiguous() is free when b already is).
    b_ENK = _pad_last(b_EKN.transpose(1, 2).contiguous(), _ALIGN)
    b_data = b_ENK.transpose(1, 2)
    Np = b_data.shape[2]
    out = torch.empty(R, Np, dtype=torch.bfloat16, device=a.device)
    ops.fp8_blockwise_grouped_mm(
        a_data,
        a.scale.float().contiguous(),
        b_data,
        b.scale.float().contiguous(),
        offs_E.to(device=a.device, dtype=torch.int32).contiguous(),
        out,
    )
    return out if Np == N else out[:, :N].contiguous()
