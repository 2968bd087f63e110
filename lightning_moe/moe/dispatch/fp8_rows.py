"""FP8 token rows for the exchange: quantized once before it, scales carried, gradients in high precision.

Legend: T tokens, H hidden, N rows this rank sends, M rows it receives, R rows its experts process,
S scales per row (rowwise: 1; blockwise (1, 128): ceil(H/128)), B bytes of a packed row.

A dispatcher that ``carries_fp8_rows`` (``moe/dispatch/base.py``) quantizes ``x_TH`` once, per row
or per (1, 128) tile along H, so that every row holds its own scales and can travel alone; a row
sent to K experts is quantized once, not K times. Its FP8 data and fp32 scales then move together
and are regrouped by the same index, so the experts receive exactly the rows, bit for bit, that
the local dispatcher would have given them.

Wire format (:func:`pack_rows`): one ``uint8`` row per token row, the data bytes (H, padded to a
multiple of 4) then the S scales' bytes: ``B = ceil4(H) + 4 S``. One all-to-all carries both,
instead of one for the data and one for the scales: half the collective launches and one set of
split sizes; unpacking is free (views), and the regroup that follows gathers data and scales
straight into contiguous tensors. Per row that is ``H + 4`` bytes (rowwise) or ``H + 4 H/128``
(blockwise: 3 % over H) against ``2 H`` for bfloat16 rows. ``gloo`` and NCCL both move ``uint8``.

The dispatch node (:func:`dispatch_fp8_rows`): forward quantizes, moves the rows along a
:class:`RowRoute` and returns a *placeholder* ``[R, H]`` (zeros in the activation dtype, zero
strides: no memory) as its differentiable output, with the real rows in the returned
:class:`~lightning_moe.ops.fp8.quantize.Fp8Tensor`. The experts consume the FP8 rows and return the
real ``[R, H]`` input gradient for the placeholder; backward sends it back along the route in the
activation dtype, exactly as the bfloat16 path sends its gradient.

Under sequence parallel with ETP (the ETP ranks hold different tokens), :func:`gather_expert_fp8_rows`
all-gathers the received FP8 rows over the ETP group the same way (packed, one collective) and
regroups them expert-major, as ``comm.gather_expert_rows`` does for activation-dtype rows; its
backward reduce-scatters the placeholder's gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_moe.moe.dispatch.base import Fp8Rows
from lightning_moe.moe.dispatch.comm import ExpertRowsLayout, all_gather_rows
from lightning_moe.moe.dispatch.comm import _gather_rows as _all_gather_rows_impl
from lightning_moe.moe.dispatch.comm import _scatter_rows as _reduce_scatter_rows_impl
from lightning_moe.ops.permute import reorder_rows

if TYPE_CHECKING:
    from lightning_moe.ops.fp8.quantize import Fp8Tensor

__all__ = [
    "RowRoute",
    "dispatch_fp8_rows",
    "gather_expert_fp8_rows",
    "gather_rows",
    "pack_rows",
    "placeholder_rows",
    "quantize_rows",
    "row_bytes",
    "scales_per_row",
    "unpack_rows",
]

_BLOCK = 128  # the blockwise activation tile's extent along H


def scales_per_row(H: int, recipe: str) -> int:
    """S: one scale per row (rowwise) or per 128 columns (blockwise, the last tile may be partial)."""
    return 1 if recipe == "rowwise" else -(-H // _BLOCK)


def _data_bytes(H: int) -> int:
    return -(-H // 4) * 4  # the scales start 4-byte aligned, so they are viewed as fp32 in place


def row_bytes(H: int, spec: Fp8Rows) -> int:
    """B: bytes of one packed row (data padded to a multiple of 4, then its fp32 scales)."""
    return _data_bytes(H) + 4 * scales_per_row(H, spec[0])


def quantize_rows(x_TH: torch.Tensor, spec: Fp8Rows) -> Fp8Tensor:
    """``x_TH`` quantized along H: one scale per row (rowwise) or per (1, 128) tile (blockwise)."""
    from lightning_moe.ops.fp8.quantize import quantize

    recipe, fmt, pow2 = spec
    tile = (1, _BLOCK) if recipe == "blockwise" else None
    return quantize(x_TH.detach(), recipe, fmt, reduce_dim=-1, tile=tile, pow2_scales=pow2)  # type: ignore[arg-type]


def _fp8_tensor(data: torch.Tensor, scale: torch.Tensor, spec: Fp8Rows) -> Fp8Tensor:
    from lightning_moe.ops.fp8.quantize import Fp8Tensor

    recipe, fmt, _ = spec
    tile = (1, _BLOCK) if recipe == "blockwise" else None
    return Fp8Tensor(data=data, scale=scale, recipe=recipe, fmt=fmt, reduce_dim=-1, tile=tile)  # type: ignore[arg-type]


def _spec_of(q: Fp8Tensor) -> Fp8Rows:
    return (q.recipe, q.fmt, False)  # pow2 only shapes the values; moving rows never needs it


def gather_rows(q: Fp8Tensor, index_R: torch.Tensor) -> Fp8Tensor:
    """Rows ``index_R`` of ``q`` (data and scales by the same index), contiguous.

    Works on the ``uint8`` view of the data (a gather of bytes, on any device) and on views into
    a packed buffer (:func:`unpack_rows`), which it copies out.
    """
    index_R = index_R.long()
    data = q.data.view(torch.uint8).index_select(0, index_R).view(q.data.dtype)
    scale = q.scale.index_select(0, index_R)
    return _fp8_tensor(data, scale, _spec_of(q))


def pack_rows(q: Fp8Tensor, index_N: torch.Tensor | None = None) -> torch.Tensor:
    """``uint8 [N, B]``: each row's data bytes (zero padding to 4) then its scales' bytes.

    ``index_N``: the rows of ``q`` to send, in send order (``None``: every row once).
    """
    T, H = q.data.shape
    S = q.scale.shape[-1]
    pad = _data_bytes(H) - H
    parts = [q.data.view(torch.uint8)]
    if pad:
        parts.append(torch.zeros(T, pad, dtype=torch.uint8, device=q.data.device))
    parts.append(q.scale.to(torch.float32).contiguous().view(T, S).view(torch.uint8))
    packed_TB = torch.cat(parts, dim=1)
    return packed_TB if index_N is None else packed_TB.index_select(0, index_N.long())


def unpack_rows(packed_MB: torch.Tensor, H: int, spec: Fp8Rows) -> Fp8Tensor:
    """The :class:`Fp8Tensor` a packed buffer holds, as views into it (no copy)."""
    M, B = packed_MB.shape
    D = _data_bytes(H)
    S = scales_per_row(H, spec[0])
    if B != D + 4 * S:
        raise ValueError(f"unpack_rows: rows of {B} bytes do not hold H={H} FP8 values and {S} scales ({D + 4 * S}).")
    from lightning_moe.ops.fp8.recipe import FP8_DTYPE

    data = packed_MB[:, :H].view(FP8_DTYPE[spec[1]])
    scale = packed_MB[:, D:].view(torch.float32)  # [M, S]: B and D are multiples of 4
    return _fp8_tensor(data, scale, spec)


def placeholder_rows(like: torch.Tensor, rows: int, H: int) -> torch.Tensor:
    """``[rows, H]`` zeros in ``like``'s dtype and device with zero strides (one element of memory)."""
    return like.new_zeros((1, 1)).expand(rows, H)


class RowRoute(Protocol):
    """Where a dispatcher's FP8 rows go (no autograd): forward and its adjoint for the gradient."""

    def send(self, q_TH: Fp8Tensor) -> Fp8Tensor:
        """The quantized tokens -> the rows its experts process, grouped by local expert (contiguous)."""
        ...

    def send_back(self, grad_RH: torch.Tensor) -> torch.Tensor:
        """The rows' gradient (activation dtype) -> the tokens' gradient ``grad_TH``."""
        ...


class _Fp8Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TH: torch.Tensor, route: RowRoute, spec: Fp8Rows, box: dict) -> torch.Tensor:  # type: ignore[override]
        x_fp8 = route.send(quantize_rows(x_TH, spec))
        box["x_fp8"] = x_fp8
        ctx.route = route
        ctx.num_tokens = x_TH.shape[0]
        return placeholder_rows(x_TH, x_fp8.data.shape[0], x_TH.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_RH: torch.Tensor):  # type: ignore[override]
        return ctx.route.send_back(grad_RH.contiguous()), None, None, None


def dispatch_fp8_rows(x_TH: torch.Tensor, route: RowRoute, spec: Fp8Rows) -> tuple[torch.Tensor, Fp8Tensor]:
    """Quantize ``x_TH`` once, move its rows along ``route`` -> (placeholder ``x_RH``, FP8 rows).

    The placeholder is the differentiable output: the gradient the experts return for it goes
    back through ``route.send_back`` into ``x_TH``'s gradient.
    """
    if x_TH.dim() != 2:
        raise ValueError(f"dispatch_fp8_rows: x_TH has shape {tuple(x_TH.shape)}; pass [T, H] rows.")
    box: dict = {}
    x_RH = _Fp8Dispatch.apply(x_TH, route, spec, box)
    return x_RH, box["x_fp8"]


class _Fp8GatherExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_RH: torch.Tensor, x_fp8: Fp8Tensor, layout: ExpertRowsLayout, box: dict) -> torch.Tensor:  # type: ignore[override]
        H = x_RH.shape[-1]
        packed_GB = _all_gather_rows_impl(pack_rows(x_fp8), layout.rows, layout.group)
        box["x_fp8"] = gather_rows(unpack_rows(packed_GB, H, _spec_of(x_fp8)), layout.regroup_G)
        ctx.layout = layout
        return placeholder_rows(x_RH, packed_GB.shape[0], H)

    @staticmethod
    def backward(ctx: Any, grad_GH: torch.Tensor):  # type: ignore[override]
        L: ExpertRowsLayout = ctx.layout
        grad_GH = grad_GH.contiguous().index_select(0, L.unregroup_G)  # back to source-major
        return _reduce_scatter_rows_impl(grad_GH, L.rows, L.rank, L.group), None, None, None


def gather_expert_fp8_rows(
    x_RH: torch.Tensor, x_fp8: Fp8Tensor, weights_R: torch.Tensor, tokens_per_expert_e: torch.Tensor, group: Any
) -> tuple[torch.Tensor, Fp8Tensor, torch.Tensor, torch.Tensor, ExpertRowsLayout]:
    """``comm.gather_expert_rows`` for FP8 rows: the ETP group's rows, expert-major, for every ETP rank.

    Legend: Q ranks of ``group``, G rows gathered. ``x_RH`` is the placeholder of this rank's FP8
    rows ``x_fp8``. Collectives: all-gather(ETP) of the ``[e]`` counts (# SYNC: the row counts go
    to the host), all-gather(ETP) of the packed rows (data and scales together) and of the weights.
    Returns the placeholder ``x_GH``, the rows ``x_fp8`` ``[G, H]``, ``weights_G``, the rows per
    local expert of the whole group and the layout ``comm.scatter_expert_rows`` undoes. Backward:
    reduce-scatter(ETP) of the placeholder's gradient (each rank's is partial over its F slice).
    """
    Q, e = group.size(), tokens_per_expert_e.shape[0]
    counts_Qe = tokens_per_expert_e.new_empty(Q * e)  # flat: gloo gathers into a 1-D buffer
    torch.distributed.all_gather_into_tensor(counts_Qe, tokens_per_expert_e.contiguous(), group=group)
    counts_Qe = counts_Qe.view(Q, e)
    rows = counts_Qe.sum(1).tolist()  # SYNC: the gathered buffers' sizes
    rank = group.rank()
    # gathered rows are [source rank][local expert]; sort stably by local expert -> [expert][source rank]
    expert_of_row_G = torch.repeat_interleave(torch.arange(e, device=counts_Qe.device).repeat(Q), counts_Qe.reshape(-1))
    regroup_G = torch.argsort(expert_of_row_G, stable=True)
    unregroup_G = torch.empty_like(regroup_G)
    unregroup_G[regroup_G] = torch.arange(regroup_G.numel(), device=regroup_G.device)
    layout = ExpertRowsLayout(rows, rank, group, regroup_G, unregroup_G)
    box: dict = {}
    x_GH = _Fp8GatherExpertRows.apply(x_RH, x_fp8, layout, box)
    w_G = reorder_rows(all_gather_rows(weights_R, rows, rank, group), regroup_G, unregroup_G)
    return x_GH, box["x_fp8"], w_G, counts_Qe.sum(0), layout
