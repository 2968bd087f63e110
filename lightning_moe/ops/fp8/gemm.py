"""FP8 GEMMs on quantized operands: one matmul, the grouped expert GEMM, the grouped weight gradient.

Legend: M rows, K contracted width, N output width, E experts, R rows sorted by expert.
``offs_E`` is the inclusive cumulative row count per expert (int32, ``F.grouped_mm``'s form).
Rows past ``offs_E[-1]`` are zero in the output; experts with no rows get zero weight gradients.

Operands are ``Fp8Tensor`` (``quantize.py``) whose units are constant along the contracted dim:
``a`` quantized with reduce_dim=-1, ``b`` with reduce_dim=-2 (tensorwise and square blockwise tiles
serve either way, e.g. a ``(128, 128)`` weight after ``.transpose()``); the weight-gradient operands
come from ``quantize_grouped_rows``. The scale convention and the non-finite rule are those of
``recipe.py``: a NaN unit makes every output it touches NaN.

Backends:

* ``emulate`` — dequantize to fp32, fp32 matmul (one per expert), cast to ``out_dtype``: the math
  every backend equals. Runs anywhere; the grouped forms read ``offs_E`` on the host.
* ``torch`` — CUDA sm_89+. ``torch._scaled_grouped_mm`` (rowwise fp32 scales, e4m3 operands, bf16
  output; a tensorwise scale is the same kernel with its scale broadcast) for the grouped GEMM and
  the weight gradient; ``torch._scaled_mm`` for one matmul (tensorwise, rowwise, and blockwise
  ``1x128 x 128x128`` / ``1x128 x 1x128`` through ``F.scaled_mm``'s ``ScalingType`` where the GPU
  runs it). What the grouped kernel cannot take (blockwise, e5m2, an output other than bf16) runs as
  one ``_scaled_mm`` per expert (reads ``offs_E`` on the host). torch's FP8 GEMMs need K and N
  multiples of 16 (blockwise: K a multiple of 128, rows a multiple of 4), column-major ``b``,
  16-byte aligned data and scale pointers and group starts: the wrappers pad with zeros (zero data
  adds nothing to a dot product), copy what is misaligned, and slice the output. Two e5m2
  operands, or blockwise with an e5m2 operand, raise a ``ValueError`` naming the recipe, as does a
  recipe this GPU's torch cannot run.
* ``cutlass`` — the blockwise grouped kernel of ``ops/fp8/kernels.py`` for ``fp8_grouped_mm``
  (what it cannot write, an output other than bf16, runs as ``torch``); the other two GEMMs run
  as ``torch``. ``auto`` picks it for the blockwise recipe on sm_90 where it builds.

Measured (2026-12-02, 1x H200, torch 2.11, E=8, R=16384, K=4096, N=2048, bf16 out; mean of 20
calls, the weight gradient 5): ``fp8_grouped_mm`` rowwise 0.36 ms (767 TFLOP/s; the bare
``_scaled_grouped_mm`` 0.26 ms) against 0.37 ms for bf16 ``F.grouped_mm``; blockwise (one
``_scaled_mm`` per expert) 1.4 ms; ``fp8_grouped_wgrad`` rowwise 2.1 ms against 0.38 ms for bf16
(its kernel was not timed apart from the move of each expert's rows into 16-aligned segments,
two byte transposes). Quantizing the [R, K] rows takes 0.8 ms, the weights 1.2 ms, grouped rows
3.3 ms (torch ops, unfused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from lightning_moe.config import Fp8Backend
from lightning_moe.ops.fp8.quantize import Fp8Tensor
from lightning_moe.ops.fp8.recipe import BLOCK

__all__ = [
    "Fp8GemmBackend",
    "auto_fp8_backend",
    "grouped_mm_route",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8_mm",
    "resolve_fp8_backend",
]

Fp8GemmBackend = Literal["emulate", "torch", "cutlass"]
_REQUESTS = get_args(Fp8Backend)  # Fp8Config.backend: "auto" or one of Fp8GemmBackend
BLOCKWISE_ROWS = 4  # cuBLAS's blockwise FP8 GEMM refuses row counts off this multiple (measured on H200)
CPU_MESSAGE = "FP8 on CPU runs only as emulation; set Fp8Config(backend='emulate')"


# ---- backend choice ------------------------------------------------------------------------------


def resolve_fp8_backend(requested: str, device: torch.device | str, recipe: str) -> Fp8GemmBackend:
    """The backend for ``requested`` (``auto``, ``emulate``, ``torch``, ``cutlass``) on ``device``.

    ``emulate`` runs anywhere. Anything else needs CUDA with compute capability 8.9+ (FP8 tensor
    cores): on CPU it raises (FP8 on CPU runs only as emulation), on an older GPU it raises naming
    the capability. ``auto`` on such a GPU picks ``torch``; ``cutlass`` runs the blockwise recipe only."""
    if requested not in _REQUESTS:
        raise ValueError(f"unknown FP8 GEMM backend {requested!r}; choose one of {_REQUESTS}")
    if recipe not in ("tensorwise", "rowwise", "blockwise"):
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of ('tensorwise', 'rowwise', 'blockwise')")
    if requested == "emulate":
        return "emulate"
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{CPU_MESSAGE} (device {device}, backend={requested!r})")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"FP8 GEMMs need a GPU of compute capability 8.9 or newer (FP8 tensor cores); "
            f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}. Set Fp8Config(backend='emulate') "
            "to emulate FP8 on it, or run without FP8 (MoEConfig.fp8=None)."
        )
    if requested == "cutlass":
        if recipe != "blockwise":
            raise ValueError(f"the cutlass FP8 backend runs the blockwise recipe only, not {recipe!r}; use backend='torch'")
        return "cutlass"
    if requested == "torch":
        return "torch"
    return auto_fp8_backend(recipe, cap, _cutlass_ready)


def _cutlass_ready() -> bool:
    from lightning_moe.ops.fp8 import kernels  # the optional CUTLASS build

    return kernels.cutlass_blockwise_available()


def auto_fp8_backend(recipe: str, capability: tuple[int, int], cutlass_ready: Callable[[], bool]) -> Fp8GemmBackend:
    """``auto`` on a GPU of ``capability`` (8.9+): ``cutlass`` for the blockwise recipe on sm_90 where
    the CUTLASS kernel builds (``cutlass_ready()``, asked only then), else ``torch``, whose blockwise
    GEMM is one ``_scaled_mm`` per expert (a host sync)."""
    if recipe == "blockwise" and capability == (9, 0) and cutlass_ready():
        return "cutlass"
    return "torch"


def grouped_mm_route(backend: str, cutlass_takes: bool) -> Fp8GemmBackend:
    """Who runs one ``fp8_grouped_mm``: the resolved ``backend``, except that ``cutlass`` hands what
    its kernel does not take (``cutlass_takes`` False: an output dtype other than bf16, operands that
    are not blockwise e4m3) to ``torch``."""
    if backend == "cutlass" and not cutlass_takes:
        return "torch"
    return backend  # type: ignore[return-value]


# ---- operand checks ------------------------------------------------------------------------------


def _contracts_over(t: Fp8Tensor, dim: int) -> bool:
    """Whether ``t``'s units are constant along ``dim`` slices, so a GEMM may contract over ``dim``."""
    if t.recipe == "tensorwise" or t.reduce_dim == dim:
        return True
    return t.recipe == "blockwise" and t.tile is not None and t.tile[0] == t.tile[1]


def _check_operand(t: object, name: str, ndim: int, dim: int) -> Fp8Tensor:
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (from quantize), got {type(t).__name__}")
    if t.data.dim() != ndim or t.grouped:
        raise ValueError(f"{name} must be a {ndim}-D Fp8Tensor from quantize, got shape {tuple(t.shape)} (grouped={t.grouped})")
    if not _contracts_over(t, dim):
        raise ValueError(
            f"{name} is quantized {t.recipe} with reduce_dim={t.reduce_dim}, but this GEMM contracts over its dim {dim}; "
            f"quantize it with reduce_dim={dim}"
        )
    return t


def _check_offs(offs_E: object, E: int | None, device: torch.device) -> torch.Tensor:
    if not isinstance(offs_E, torch.Tensor) or offs_E.dim() != 1 or offs_E.is_floating_point():
        raise TypeError(f"offs_E must be a 1-D integer tensor of inclusive row offsets, got {offs_E!r}")
    if E is not None and offs_E.shape[0] != E:
        raise ValueError(f"offs_E has {offs_E.shape[0]} entries for {E} experts")
    return offs_E.to(device=device, dtype=torch.int32)


def _bounds(offs_E: torch.Tensor) -> list[int]:
    return [0] + offs_E.tolist()  # SYNC: the per-expert paths need host-side row ranges


def _zero_tail(y_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows past ``offs_E[-1]`` set to zero (device-side)."""
    if offs_E.shape[0] == 0:
        return torch.zeros_like(y_RN)
    r_R = torch.arange(y_RN.shape[0], device=y_RN.device)
    return torch.where((r_R < offs_E[-1])[:, None], y_RN, torch.zeros((), dtype=y_RN.dtype, device=y_RN.device))


# ---- emulate -------------------------------------------------------------------------------------


def _emulate_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (a.dequantize() @ b.dequantize()).to(out_dtype)


def _emulate_grouped_mm(a: Fp8Tensor, b: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    a_RK, b_EKN = a.dequantize(), b.dequantize()
    y_RN = a_RK.new_zeros(a_RK.shape[0], b_EKN.shape[-1])
    bounds = _bounds(offs_E)
    for e in range(b_EKN.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y_RN[lo:hi] = a_RK[lo:hi] @ b_EKN[e]
    return y_RN.to(out_dtype)


def _emulate_wgrad(x: Fp8Tensor, dy: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    x_RK, dy_RN = x.dequantize(), dy.dequantize()
    E = offs_E.shape[0]
    dw_EKN = x_RK.new_zeros(E, x_RK.shape[1], dy_RN.shape[1])
    bounds = _bounds(offs_E)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            dw_EKN[e] = x_RK[lo:hi].t() @ dy_RN[lo:hi]
    return dw_EKN.to(out_dtype)


# ---- torch: padding and layouts ------------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_fp8(data: torch.Tensor, last: int, second: int = 0) -> torch.Tensor:
    """Zero-pad the last dim by ``last`` and dim -2 by ``second`` (fp8 zero is the byte 0)."""
    if last == 0 and second == 0:
        return data
    return F.pad(data.view(torch.uint8), (0, last, 0, second)).view(data.dtype)


def _col_major(data: torch.Tensor) -> torch.Tensor:
    """The same values with column-major last two dims (a copy unless they already are)."""
    if data.stride(-2) == 1 and data.stride(-1) >= max(1, data.shape[-2]):
        return data
    return data.transpose(-1, -2).contiguous().transpose(-1, -2)


def _b_operand(data_KN: torch.Tensor, pad_k: int, pad_n: int) -> torch.Tensor:
    """The second operand column-major and zero-padded (padded in its transposed frame, so a
    column-major input, as ``quantize(..., reduce_dim=-2)`` makes it, is never transposed)."""
    return _col_major(_pad_fp8(data_KN.transpose(-1, -2), pad_k, pad_n).transpose(-1, -2))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (cuBLAS refuses scale pointers off it)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _aligned_col(t: torch.Tensor) -> torch.Tensor:
    """A column-major ``t`` at a 16-byte aligned address."""
    return t if t.data_ptr() % 16 == 0 else t.transpose(-1, -2).clone().transpose(-1, -2)


def _pad_scale(scale: torch.Tensor, last: int, second: int = 0) -> torch.Tensor:
    """Pad a scale grid with ones (the units it adds cover zero data)."""
    if last == 0 and second == 0:
        return scale
    return F.pad(scale, (0, last, 0, second), value=1.0)


def _pair(a: Fp8Tensor, b: Fp8Tensor) -> str:
    """The torch scaling pair of (a, b), or a ValueError naming what torch cannot take."""
    if a.recipe != b.recipe:
        raise ValueError(f"backend='torch' needs one recipe for both operands, got {a.recipe!r} and {b.recipe!r}")
    if a.fmt == "e5m2" and b.fmt == "e5m2":
        raise ValueError("backend='torch': torch's FP8 GEMMs take at most one e5m2 operand; quantize one side as e4m3")
    if a.recipe != "blockwise":
        return a.recipe
    if a.fmt != "e4m3" or b.fmt != "e4m3":
        raise ValueError(
            f"backend='torch' runs the blockwise recipe with e4m3 operands only (got {a.fmt} x {b.fmt}); "
            "use Fp8Config(grad_format='e4m3') (the DeepSeek-V3 recipe) or backend='emulate'"
        )
    ta, tb = a.tile, b.tile
    if ta == (1, BLOCK) and tb == (BLOCK, BLOCK):
        return "1x128,128x128"
    if ta == (1, BLOCK) and tb == (1, BLOCK):
        return "1x128,1x128"
    raise ValueError(
        f"backend='torch' runs blockwise tiles (1, 128) x (128, 128) or (1, 128) x (1, 128), got {ta} x {tb}; "
        "use backend='emulate'"
    )


@functools.cache
def _blockwise_probe(device_index: int, pair: str) -> str | None:
    """``None`` when torch runs this blockwise pair on the GPU, else the reason (one tiny GEMM)."""
    dev = torch.device("cuda", device_index)
    a = torch.zeros(128, 128, device=dev).to(torch.float8_e4m3fn)
    b = torch.zeros(128, 128, device=dev).to(torch.float8_e4m3fn)
    sa = torch.ones(128, 1, device=dev)
    sb = torch.ones(1, 1, device=dev) if pair == "1x128,128x128" else torch.ones(1, 128, device=dev)
    try:
        _scaled_mm_blockwise(a, _col_major(b), sa, sb, pair, torch.bfloat16)
    except Exception as err:  # noqa: BLE001 - any refusal of torch's kernel means "not here"
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def _outer_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` [A, B] copied to strides ``(1, A)`` (torch wants them exactly, also where B is 1)."""
    out = torch.empty_strided(tuple(t.shape), (1, max(t.shape[0], 1)), dtype=torch.float32, device=t.device)
    return out.copy_(t)  # a fresh allocation: aligned


def _scaled_mm_blockwise(
    a_MK: torch.Tensor, b_KN: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, pair: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """``F.scaled_mm`` with blockwise scales in our grid layout (``sa`` [M, K/128]; ``sb`` [K/128, N/128]
    for 128x128 tiles or [K/128, N] for 1x128 tiles), laid out as torch wants them (outer-dim major;
    the 128x128 grid with its K blocks padded to a multiple of 4)."""
    ST = _scaling_types()
    if ST is None or not hasattr(F, "scaled_mm"):
        raise NotImplementedError(f"torch {torch.__version__} has no F.scaled_mm with ScalingType")
    K = a_MK.shape[1]
    sa_t = _outer_major(sa)  # [M, K/128], stride [1, M]
    if pair == "1x128,128x128":
        l4 = _round_up(K // BLOCK, 4)
        sb_t = _outer_major(_pad_scale(sb, 0, l4 - sb.shape[0]))  # [L4, N/128], stride [1, L4]
        recipe_b = ST.BlockWise128x128
    else:
        sb_t = _outer_major(sb.t())  # [N, K/128], stride [1, N]
        recipe_b = ST.BlockWise1x128
    return F.scaled_mm(a_MK, b_KN, sa_t, ST.BlockWise1x128, sb_t, recipe_b, output_dtype=out_dtype)


def _scaling_types():
    return getattr(F, "ScalingType", None)


def _torch_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One ``a @ b`` on torch's FP8 GEMM, padded to its size rules."""
    pair = _pair(a, b)
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return torch.zeros(M, N, dtype=out_dtype, device=a.device)
    if K == 0:
        return torch.zeros(M, N, dtype=out_dtype, device=a.device)
    if pair in ("tensorwise", "rowwise"):
        Kp, Np = _round_up(K, 16), _round_up(N, 16)
        a_d = _pad_fp8(a.data, Kp - K).contiguous()
        b_d = _b_operand(b.data, Kp - K, Np - N)
        if pair == "tensorwise":
            sa, sb = a.scale.reshape(1, 1), b.scale.reshape(1, 1)
        else:
            sa = a.scale.reshape(M, 1)
            sb = _pad_scale(b.scale.reshape(1, N), Np - N)
        y = torch._scaled_mm(_aligned(a_d), _aligned_col(b_d), _aligned(sa), _aligned(sb), out_dtype=out_dtype)
        return y[:, :N]
    reason = _blockwise_probe(a.device.index or 0, pair)
    if reason is not None:
        raise ValueError(
            f"backend='torch' cannot run the blockwise recipe ({pair}) on this GPU: {reason}. "
            "Use Fp8Config(backend='cutlass') or 'emulate', or recipe='rowwise'."
        )
    Kp = _round_up(K, BLOCK)
    Np = _round_up(N, BLOCK) if pair == "1x128,128x128" else _round_up(N, 16)
    Mp = _round_up(M, BLOCKWISE_ROWS)
    a_d = _pad_fp8(a.data, Kp - K, Mp - M).contiguous()
    sa = _pad_scale(a.scale, 0, Mp - M)
    b_d = _b_operand(b.data, Kp - K, Np - N)
    sb = b.scale
    if pair == "1x128,1x128":
        sb = _pad_scale(sb, Np - N)
    else:
        sb = _pad_scale(sb, Np // BLOCK - sb.shape[1])
    return _scaled_mm_blockwise(_aligned(a_d), _aligned_col(b_d), sa, sb, pair, out_dtype)[:M, :N]


def _grouped_kernel_takes(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs these operands (rowwise fp32 scales, e4m3, bf16 out)."""
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and a.recipe in ("tensorwise", "rowwise")
        and b.recipe in ("tensorwise", "rowwise")
        and a.fmt == "e4m3"
        and b.fmt == "e4m3"
        and out_dtype == torch.bfloat16
        and torch.cuda.get_device_capability(a.device) >= (9, 0)
    )


def _row_scales(t: Fp8Tensor, rows: int) -> torch.Tensor:
    """Per-row scales of a 2-D operand contracted over its last dim, as a [rows] vector."""
    return t.scale.reshape(-1).expand(rows) if t.recipe == "tensorwise" else t.scale.reshape(rows)


def _torch_grouped_mm(a: Fp8Tensor, b: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    R, K = a.shape
    E, _, N = b.shape
    if R == 0 or N == 0 or K == 0 or E == 0:
        return torch.zeros(R, N, dtype=out_dtype, device=a.device)
    if not _grouped_kernel_takes(a, b, out_dtype):
        return _per_expert_mm(a, b, offs_E, out_dtype)
    Kp, Np = _round_up(K, 16), _round_up(N, 16)
    a_d = _pad_fp8(a.data, Kp - K).contiguous()
    b_d = _b_operand(b.data, Kp - K, Np - N)
    sa = _aligned(_row_scales(a, R))
    sb = b.scale.reshape(E, -1).expand(E, N) if b.recipe == "tensorwise" else b.scale.reshape(E, N)
    sb = _aligned(_pad_scale(sb, Np - N))
    y = torch._scaled_grouped_mm(_aligned(a_d), _aligned_col(b_d), sa, sb, offs=offs_E, out_dtype=torch.bfloat16)
    return _zero_tail(y[:, :N], offs_E)


def _slice_rows(a: Fp8Tensor, lo: int, hi: int) -> Fp8Tensor:
    scale = a.scale if a.recipe == "tensorwise" else a.scale[lo:hi]
    return Fp8Tensor(a.data[lo:hi], scale, a.recipe, a.fmt, a.reduce_dim, a.tile)


def _expert(b: Fp8Tensor, e: int) -> Fp8Tensor:
    return Fp8Tensor(b.data[e], b.scale[e], b.recipe, b.fmt, b.reduce_dim, b.tile)


def _per_expert_mm(a: Fp8Tensor, b: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    R, N = a.shape[0], b.shape[-1]
    y = torch.zeros(R, N, dtype=out_dtype, device=a.device)
    bounds = _bounds(offs_E)
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = _torch_mm(_slice_rows(a, lo, hi), _expert(b, e), out_dtype)
    return y


def _grouped_row_scale_matrix(t: Fp8Tensor, width: int) -> torch.Tensor:
    """A rowwise/tensorwise grouped-rows scale as [E, width]."""
    E = t.offs.shape[0] if t.offs is not None else 0
    return t.scale.expand(E, width) if t.recipe == "tensorwise" else t.scale


def aligned_segments(offs_E: torch.Tensor, R: int, align: int = 16) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each expert's rows moved to a segment starting at a multiple of ``align`` (device-side).

    Returns ``dest_R`` (each row's new position; rows past ``offs_E[-1]`` go to ``Rp``, a slot
    outside every segment), the segments' inclusive offsets and ``Rp``, a static bound of their
    total length (``round_up(R, align) + align * E``). The weight-gradient kernel contracts over
    the rows, and each group's first row must start on a 16-byte boundary."""
    E = offs_E.shape[0]
    counts_E = offs_E - torch.cat([offs_E.new_zeros(1), offs_E[:-1]])
    padded_E = torch.div(counts_E + (align - 1), align, rounding_mode="floor") * align
    padded_offs_E = torch.cumsum(padded_E, 0, dtype=torch.int32)
    Rp = _round_up(R, align) + align * E
    r_R = torch.arange(R, device=offs_E.device, dtype=torch.int32)
    e_R = torch.searchsorted(offs_E, r_R, right=True)
    e_c = e_R.clamp_max(E - 1)
    dest_R = r_R - (offs_E[e_c] - counts_E[e_c]) + (padded_offs_E[e_c] - padded_E[e_c])
    dest_R = torch.where(e_R < E, dest_R, torch.full_like(dest_R, Rp))
    return dest_R, padded_offs_E, Rp


def _torch_wgrad(x: Fp8Tensor, dy: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    R, K = x.shape
    N = dy.shape[1]
    E = offs_E.shape[0]
    if R == 0 or K == 0 or N == 0 or E == 0:
        return torch.zeros(E, K, N, dtype=out_dtype, device=x.device)
    if x.recipe != dy.recipe:
        raise ValueError(f"backend='torch' needs one recipe for both operands, got {x.recipe!r} and {dy.recipe!r}")
    if x.recipe == "blockwise" or not _grouped_kernel_takes(x, dy, out_dtype):
        return _per_expert_wgrad(x, dy, offs_E, out_dtype)
    dest_R, padded_offs_E, Rp = aligned_segments(offs_E, R)
    # [K, R] row-major and [R, N] column-major with each expert's rows at its padded offset; K and N
    # padded to multiples of 16 (torch's shape rule); one spare 16-column block takes the rows of no
    # expert and keeps the row stride 16-byte aligned
    Kp, Np = _round_up(K, 16), _round_up(N, 16)
    xt = torch.zeros(Kp, Rp + 16, dtype=torch.uint8, device=x.device)
    xt[:K].index_copy_(1, dest_R.long(), x.data.view(torch.uint8).t())
    dyt = torch.zeros(Np, Rp + 16, dtype=torch.uint8, device=x.device)
    dyt[:N].index_copy_(1, dest_R.long(), dy.data.view(torch.uint8).t())
    a_KR = xt[:, :Rp].view(x.data.dtype)
    b_RN = dyt[:, :Rp].view(dy.data.dtype).t()
    sa = _pad_scale(_grouped_row_scale_matrix(x, K), Kp - K).contiguous().reshape(-1)
    sb = _pad_scale(_grouped_row_scale_matrix(dy, N), Np - N).contiguous().reshape(-1)
    dw = torch._scaled_grouped_mm(a_KR, b_RN, sa, sb, offs=padded_offs_E, out_dtype=torch.bfloat16)
    return dw[:, :K, :N]


def _per_expert_wgrad(x: Fp8Tensor, dy: Fp8Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One ``_scaled_mm`` per expert: ``x_e^T [K, n_e] @ dy_e [n_e, N]`` (contracted rows padded)."""
    R, K = x.shape
    N = dy.shape[1]
    E = offs_E.shape[0]
    dw = torch.zeros(E, K, N, dtype=out_dtype, device=x.device)
    bounds = _bounds(offs_E)
    tile0 = 0
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        n = hi - lo
        tiles = -(-n // BLOCK)
        if n == 0:
            continue
        xe = x.data[lo:hi].t()  # [K, n]
        dye = dy.data[lo:hi]  # [n, N]
        if x.recipe == "blockwise":
            # x_e^T is contracted over its rows n in (1, 128) tiles along n; so is dy_e (as b: 1x128 along its K)
            sa = x.scale[tile0 : tile0 + tiles].t()  # [K, n/128]
            sb = dy.scale[tile0 : tile0 + tiles]  # [n/128, N]
            tile0 += tiles
            a = Fp8Tensor(xe.contiguous(), sa, "blockwise", x.fmt, -1, (1, BLOCK))
            b = Fp8Tensor(dye, sb, "blockwise", dy.fmt, -2, (1, BLOCK))
        else:
            if x.recipe == "tensorwise":
                sa, sb = x.scale[e].reshape(1, 1), dy.scale[e].reshape(1, 1)
            else:
                sa, sb = x.scale[e].reshape(K, 1), dy.scale[e].reshape(1, N)
            a = Fp8Tensor(xe.contiguous(), sa, x.recipe, x.fmt, -1, None)
            b = Fp8Tensor(dye, sb, dy.recipe, dy.fmt, -2, None)
        dw[e] = _torch_mm(a, b, out_dtype)
    return dw


# ---- public GEMMs --------------------------------------------------------------------------------


def _check_backend(backend: object) -> str:
    if backend not in ("emulate", "torch", "cutlass"):
        raise ValueError(f"unknown FP8 GEMM backend {backend!r}; resolve one with resolve_fp8_backend")
    return backend  # type: ignore[return-value]


def _check_cuda(t: Fp8Tensor, backend: str) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{CPU_MESSAGE} (backend={backend!r} got tensors on {t.device})")


def fp8_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16, backend: Fp8GemmBackend = "emulate") -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` in ``out_dtype`` (a contracted over dim -1, b over dim -2)."""
    backend = _check_backend(backend)
    _check_operand(a, "a", 2, -1)
    _check_operand(b, "b", 2, -2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; their K differ")
    if backend == "emulate":
        return _emulate_mm(a, b, out_dtype)
    _check_cuda(a, backend)
    return _torch_mm(a, b, out_dtype)


def fp8_grouped_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    offs_E: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: Fp8GemmBackend = "emulate",
) -> torch.Tensor:
    """Per expert ``y[rows of e] = a[rows of e] @ b[e]``: ``a [R, K]``, ``b [E, K, N]`` -> ``[R, N]``."""
    backend = _check_backend(backend)
    _check_operand(a, "a", 2, -1)
    _check_operand(b, "b", 3, -2)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_grouped_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; their K differ")
    offs = _check_offs(offs_E, b.shape[0], a.device)
    if backend == "emulate":
        return _emulate_grouped_mm(a, b, offs, out_dtype)
    _check_cuda(a, backend)
    if backend == "cutlass":
        from lightning_moe.ops.fp8 import kernels  # the optional CUTLASS build

        if grouped_mm_route(backend, kernels.cutlass_blockwise_takes(a, b, out_dtype)) == "cutlass":
            return kernels.cutlass_blockwise_grouped_mm(a, b, offs, out_dtype)
    return _torch_grouped_mm(a, b, offs, out_dtype)


def _check_wgrad_operand(t: object, name: str) -> Fp8Tensor:
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (from quantize_grouped_rows), got {type(t).__name__}")
    if t.data.dim() != 2 or not t.grouped:
        raise ValueError(
            f"{name} must be a 2-D grouped-rows Fp8Tensor (quantize_grouped_rows: units inside each expert's rows), "
            f"got shape {tuple(t.shape)}, grouped={t.grouped}"
        )
    return t


def fp8_grouped_wgrad(
    x: Fp8Tensor,
    dy: Fp8Tensor,
    offs_E: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: Fp8GemmBackend = "emulate",
) -> torch.Tensor:
    """Per expert ``dw[e] = x[rows of e]^T @ dy[rows of e]``: ``x [R, K]``, ``dy [R, N]`` -> ``[E, K, N]``.

    Both operands come from ``quantize_grouped_rows`` with the same ``offs_E``; experts with no rows
    get zeros."""
    backend = _check_backend(backend)
    _check_wgrad_operand(x, "x")
    _check_wgrad_operand(dy, "dy")
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"fp8_grouped_wgrad: x has {x.shape[0]} rows and dy {dy.shape[0]}")
    offs = _check_offs(offs_E, None, x.device)
    if x.offs.shape[0] != offs.shape[0] or dy.offs.shape[0] != offs.shape[0]:
        raise ValueError("fp8_grouped_wgrad: x, dy and offs_E must describe the same experts (quantize both with this offs_E)")
    if backend == "emulate":
        return _emulate_wgrad(x, dy, offs, out_dtype)
    _check_cuda(x, backend)
    return _torch_wgrad(x, dy, offs, out_dtype)
