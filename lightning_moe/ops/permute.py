"""Token permutation: group (token, slot) pairs by expert, and put them back.

Legend: T tokens, H hidden, E experts, K top-k slots per token, N = T*K slots, R rows after
permutation (N when dropless, fewer when slots are dropped, E*capacity when padded), S source
rows a permutation gathers from (T for the local dispatcher).

A permutation is described by three integer tensors (see :class:`Permutation`):

* ``slot_of_row_R`` — the flattened slot ``t*K + k`` each row came from (``-1`` for padding);
* ``slot_row_TK`` — the inverse: the row of slot ``(t, k)`` (``-1`` for a dropped slot);
* ``tokens_per_expert_E`` — rows per expert; rows of expert ``e`` are contiguous, and within an
  expert rows keep increasing slot order (a stable sort), so results are deterministic.

Two data movements use it, each the other's backward:

* :func:`permute_rows` ``x_RH[r] = x_SH[src_r]`` (a gather);
* :func:`unpermute_sum` ``out_TH[t] = sum_k w_TK[t, k] * y_RH[slot_row_TK[t, k]]`` (a gather-sum,
  no atomics, fp32 accumulation).

Each has a torch reference (the spec) and, on CUDA, the csrc kernel when it builds.
"""

from __future__ import annotations

import torch

from lightning_moe.ops.backend import csrc_extension
from lightning_moe.ops.deferred import Deferred, ResolvedOnRead

__all__ = [
    "Permutation",
    "count_per_expert",
    "build_permutation",
    "dropless_permutation",
    "build_permutation_reference",
    "permute_rows",
    "permute_rows_reference",
    "reorder_rows",
    "scatter_rows_reference",
    "unpermute_sum",
    "unpermute_sum_reference",
    "unpermute_weight_grad_reference",
]


class Permutation:
    """Where every routed slot goes (index tensors on the routing device).

    ``src_token_R`` (token each row reads; padding rows read token 0 and carry weight 0) and
    ``slot_row_TK`` are int32 — the kernels' index type — and ``slot_of_row_R`` is int64.
    ``slot_of_row_R`` and ``tokens_per_expert_E`` may be given as functions that build them on
    first read: only the row weights need the former, and they are read after the first expert
    GEMM is launched (every op before that launch is step time while the device waits for it);
    the fused local path needs neither (it takes ``offsets_E``).
    """

    __slots__ = ("_slot_of_row_R", "slot_row_TK", "_tokens_per_expert_E", "top_k", "src_token_R", "padded", "offsets_E")

    slot_of_row_R = ResolvedOnRead()
    tokens_per_expert_E = ResolvedOnRead()

    def __init__(
        self,
        slot_of_row_R: Deferred,
        slot_row_TK: torch.Tensor,
        tokens_per_expert_E: Deferred,
        top_k: int,
        src_token_R: torch.Tensor,
        padded: bool = False,  # capacity-padded: rows with ``slot_of_row == -1`` exist (known without a sync)
        offsets_E: torch.Tensor | None = None,  # inclusive int32 row ends (grouped_mm's offs), when already made
    ) -> None:
        self._slot_of_row_R = slot_of_row_R
        self.slot_row_TK = slot_row_TK
        self._tokens_per_expert_E = tokens_per_expert_E
        self.top_k = top_k
        self.src_token_R = src_token_R
        self.padded = padded
        self.offsets_E = offsets_E

    @property
    def num_rows(self) -> int:
        return self.src_token_R.shape[0]


def _make_permutation(
    slot_of_row_R: torch.Tensor,
    slot_row_TK: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    top_k: int,
    padded: bool = False,
) -> Permutation:
    src_token_R = (slot_of_row_R.clamp(min=0) // top_k).int()
    return Permutation(slot_of_row_R, slot_row_TK.int(), tokens_per_expert_E, top_k, src_token_R, padded)


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert (int64 ``[E]``); ids ``< 0`` are not counted.

    A scatter-add rather than ``torch.bincount``, which syncs with the host on CUDA to size
    its output.
    """
    ids_N = ids.reshape(-1).long()
    bins_N = torch.where(ids_N >= 0, ids_N, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, bins_N, torch.ones_like(bins_N))
    return counts[:num_experts]


def build_permutation_reference(
    topk_ids_TK: torch.Tensor, num_experts: int, capacity: int | None = None, dropless: bool = False
) -> Permutation:
    """Stable sort of slots by expert; ids ``< 0`` are dropped slots and take no row.

    ``dropless=True`` promises there is no ``-1`` id, so the row count is ``T*K`` without a
    device-to-host sync. With ``capacity`` every expert owns exactly ``capacity`` rows (static shapes): expert ``e``'s
    rows start at ``e * capacity`` and the unused tail rows are padding (``slot_of_row == -1``).
    The caller must already have dropped slots beyond capacity.
    """
    T, K = topk_ids_TK.shape
    ids_N = topk_ids_TK.reshape(-1).long()
    kept_N = ids_N >= 0
    # Dropped slots sort after every expert, so the first R rows are the kept ones.
    sort_key_N = torch.where(kept_N, ids_N, torch.full_like(ids_N, num_experts))
    order_N = torch.argsort(sort_key_N, stable=True)
    tokens_per_expert_E = count_per_expert(ids_N, num_experts)
    if capacity is not None:
        return _padded_permutation(sort_key_N, order_N, tokens_per_expert_E, capacity, T, K)
    # SYNC: with drops, the kept-row count sizes the expert buffers; dropless knows it is T*K.
    num_kept = T * K if dropless else int(kept_N.sum())
    slot_of_row_R = order_N[:num_kept]
    rows_R = torch.arange(num_kept, device=ids_N.device)
    slot_row_N = torch.full((T * K,), -1, dtype=torch.long, device=ids_N.device)
    slot_row_N[order_N[:num_kept]] = rows_R
    return _make_permutation(slot_of_row_R, slot_row_N.view(T, K), tokens_per_expert_E, K)


def _check_capacity(tokens_per_expert_E: torch.Tensor, capacity: int) -> None:
    """Guard against a caller that did not drop slots beyond capacity.

    On CUDA an asynchronous device assert (no host sync, so the padded path stays capturable);
    elsewhere a ``ValueError``.
    """
    if tokens_per_expert_E.device.type == "cuda":
        torch._assert_async((tokens_per_expert_E <= capacity).all())
    elif bool((tokens_per_expert_E > capacity).any()):  # SYNC (not on CUDA)
        raise ValueError(f"build_permutation: an expert holds more than capacity={capacity} slots.")


def _padded_permutation(
    sort_key_N: torch.Tensor, order_N: torch.Tensor, tokens_per_expert_E: torch.Tensor, capacity: int, T: int, K: int
) -> Permutation:
    """The capacity case with no device-to-host sync, so a CUDA graph can capture it.

    The i-th slot in sorted order goes to row ``e * capacity + (i - start_e)`` of its expert
    ``e``; dropped slots (sort key ``E``) take no row. Every shape is fixed by ``E * capacity``.
    """
    E = tokens_per_expert_E.shape[0]
    R = E * capacity
    _check_capacity(tokens_per_expert_E, capacity)
    sorted_key_N = sort_key_N[order_N]
    start_E = torch.cumsum(tokens_per_expert_E, 0) - tokens_per_expert_E
    pos_N = torch.arange(T * K, device=sort_key_N.device) - start_E[sorted_key_N.clamp(max=E - 1)]
    kept_N = (sorted_key_N < E) & (pos_N < capacity)
    row_N = torch.where(kept_N, sorted_key_N * capacity + pos_N, -1)
    # Dropped slots write to a spare row R, cut off below; kept slots write distinct rows.
    slot_of_row_R = torch.full((R + 1,), -1, dtype=torch.long, device=sort_key_N.device)
    slot_of_row_R.scatter_(0, torch.where(kept_N, row_N, R), order_N)
    slot_row_N = torch.empty_like(row_N).scatter_(0, order_N, row_N)
    return _make_permutation(
        slot_of_row_R[:R], slot_row_N.view(T, K), torch.full_like(tokens_per_expert_E, capacity), K, padded=True
    )


def build_permutation(
    topk_ids_TK: torch.Tensor, num_experts: int, capacity: int | None = None, dropless: bool = False
) -> Permutation:
    """Public entry: the csrc kernel on CUDA when dropless, the reference otherwise."""
    ext = csrc_extension(topk_ids_TK)
    if ext is None or capacity is not None or not dropless:
        return build_permutation_reference(topk_ids_TK, num_experts, capacity, dropless)
    return dropless_permutation(*ext.build_permutation(topk_ids_TK, num_experts))


def dropless_permutation(
    src_idx_N: torch.Tensor, slot_row_TK: torch.Tensor, counts_E: torch.Tensor, offsets_E: torch.Tensor
) -> Permutation:
    """The csrc ``build_permutation`` outputs (int32) of dropless ids as a :class:`Permutation`.

    The row → slot map and the int64 counts are built on first read (deferred)."""
    T, K = slot_row_TK.shape

    def slot_of_row() -> torch.Tensor:  # dropless: every slot has a row, so the inverse is a plain scatter
        slot_of_row_R = torch.empty(T * K, dtype=torch.long, device=slot_row_TK.device)
        return slot_of_row_R.scatter_(0, slot_row_TK.reshape(-1).long(), torch.arange(T * K, device=slot_row_TK.device))

    return Permutation(slot_of_row, slot_row_TK, counts_E.long, K, src_idx_N, offsets_E=offsets_E)


# ----------------------------------------------------------------------------------------------
# references (the spec)


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types; never lower than the input (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def permute_rows_reference(x_SH: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    """``x_RH[r] = x_SH[src_R[r]]``."""
    return x_SH.index_select(0, src_R.long())


def scatter_rows_reference(x_TH: torch.Tensor, slot_row_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``x_RH[slot_row_TK[t, k]] = x_TH[t]`` for every slot with a row (``>= 0``); rows no slot
    names are zero here (the kernel leaves them unwritten: callers use it only when every row
    has exactly one slot, where it equals :func:`permute_rows_reference`)."""
    T, K = slot_row_TK.shape
    rows_N = slot_row_TK.reshape(-1).long()
    kept_N = rows_N >= 0
    token_N = torch.arange(T, device=x_TH.device).repeat_interleave(K)
    out = x_TH.new_zeros(num_rows, x_TH.shape[-1])
    out.index_copy_(0, rows_N[kept_N], x_TH.index_select(0, token_N[kept_N]))
    return out


def unpermute_sum_reference(
    y_RH: torch.Tensor, slot_row_TK: torch.Tensor, weights_TK: torch.Tensor | None = None
) -> torch.Tensor:
    """``out_TH[t] = sum_k w[t, k] * y_RH[slot_row_TK[t, k]]``, skipping ``-1``; fp32 sum (fp64 kept)."""
    T, K = slot_row_TK.shape
    acc = _accum_dtype(y_RH.dtype)
    if y_RH.shape[0] == 0:  # no rows (every slot dropped, or nothing received): nothing to gather
        return y_RH.new_zeros(T, y_RH.shape[-1])
    kept_TK = slot_row_TK >= 0
    rows_TK = slot_row_TK.clamp(min=0).long()
    gathered_TKH = y_RH.index_select(0, rows_TK.reshape(-1)).view(T, K, y_RH.shape[-1]).to(acc)  # H named: T may be 0
    scale_TK = kept_TK.to(acc) if weights_TK is None else weights_TK.to(acc) * kept_TK
    return (gathered_TKH * scale_TK.unsqueeze(-1)).sum(1).to(y_RH.dtype)


# ----------------------------------------------------------------------------------------------
# autograd


class _PermuteRows(torch.autograd.Function):
    """Gather rows; backward is the gather-sum through the inverse map (no atomics)."""

    @staticmethod
    def forward(ctx, x_SH: torch.Tensor, perm: Permutation) -> torch.Tensor:  # type: ignore[override]
        ctx.perm = perm
        return _expert_rows_impl(x_SH, perm)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        perm: Permutation = ctx.perm
        grad_TH = _unpermute_sum_impl(grad_RH.contiguous(), perm.slot_row_TK, None)
        return grad_TH, None


class _UnpermuteSum(torch.autograd.Function):
    """Weighted gather-sum back to token order; backward is a gather (and a dot for weights)."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, perm: Permutation, weights_TK: torch.Tensor | None):  # type: ignore[override]
        ctx.perm = perm
        ctx.has_weights = weights_TK is not None
        ctx.save_for_backward(y_RH if ctx.has_weights else None, weights_TK)
        return _unpermute_sum_impl(y_RH, perm.slot_row_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):  # type: ignore[override]
        perm: Permutation = ctx.perm
        y_RH, weights_TK = ctx.saved_tensors
        grad_TH = grad_TH.contiguous()
        grad_RH = _expert_rows_impl(grad_TH, perm)
        kept_R = perm.slot_of_row_R >= 0
        if not ctx.has_weights:
            if perm.padded:  # padding rows take no gradient
                grad_RH = grad_RH * kept_R.unsqueeze(-1).to(grad_RH.dtype)
            return grad_RH, None, None
        acc = _accum_dtype(grad_TH.dtype)
        w_R = weights_TK.reshape(-1)[perm.slot_of_row_R.clamp(min=0)].to(acc) * kept_R
        grad_RH = (grad_RH.to(acc) * w_R.unsqueeze(-1)).to(grad_TH.dtype)
        grad_w_TK = None
        if ctx.needs_input_grad[2]:
            grad_w_TK = _unpermute_weight_grad_impl(grad_TH, y_RH, perm.slot_row_TK).to(weights_TK.dtype)
        return grad_RH, None, grad_w_TK


def unpermute_weight_grad_reference(
    grad_TH: torch.Tensor, y_RH: torch.Tensor, slot_row_TK: torch.Tensor
) -> torch.Tensor:
    """``grad_w[t, k] = <grad_TH[t], y_RH[slot_row_TK[t, k]]>`` (0 where the slot was dropped)."""
    acc = _accum_dtype(y_RH.dtype)
    rows_TK = slot_row_TK.clamp(min=0).long()
    T, K = rows_TK.shape
    if y_RH.shape[0] == 0:  # no rows: every slot was dropped
        return torch.zeros(T, K, dtype=acc, device=y_RH.device)
    y_TKH = y_RH.index_select(0, rows_TK.reshape(-1)).view(T, K, y_RH.shape[-1]).to(acc)  # H named: T may be 0
    return (y_TKH * grad_TH.to(acc).unsqueeze(1)).sum(-1) * (slot_row_TK >= 0)


def _unpermute_weight_grad_impl(grad_TH: torch.Tensor, y_RH: torch.Tensor, slot_row_TK: torch.Tensor) -> torch.Tensor:
    ext = csrc_extension(y_RH)
    if ext is None or grad_TH.dtype != y_RH.dtype:
        return unpermute_weight_grad_reference(grad_TH, y_RH, slot_row_TK)
    return ext.unpermute_weight_grad(grad_TH.contiguous(), y_RH.contiguous(), slot_row_TK.int().contiguous())


def _permute_rows_impl(x_SH: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    ext = csrc_extension(x_SH)
    if ext is None:
        return permute_rows_reference(x_SH, src_R)
    return ext.permute_rows(x_SH.contiguous(), src_R.int(), None)


def _expert_rows_impl(x_TH: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """``x_TH``'s rows in expert order (``x_RH``), however is fastest for ``perm``.

    Without capacity padding every row is the destination of exactly one slot, so the csrc
    kernel scatters each token's row to its K rows, reading ``x_TH`` once in order; the gather
    reads it once per slot in expert order (H200, Qwen3-30B-A3B: 0.24 ms per call). Padded
    permutations (rows without a slot must be zero), rows that are not the permutation's tokens
    and the torch path gather.
    """
    ext = csrc_extension(x_TH)
    if ext is None or perm.padded or x_TH.shape[0] != perm.slot_row_TK.shape[0]:
        return _permute_rows_impl(x_TH, perm.src_token_R)
    return ext.scatter_rows(x_TH.contiguous(), perm.slot_row_TK.int().contiguous(), perm.num_rows)


def _unpermute_sum_impl(
    y_RH: torch.Tensor, slot_row_TK: torch.Tensor, weights_TK: torch.Tensor | None
) -> torch.Tensor:
    ext = csrc_extension(y_RH)
    if ext is None:
        return unpermute_sum_reference(y_RH, slot_row_TK, weights_TK)
    w = None if weights_TK is None else weights_TK.float().contiguous()
    return ext.unpermute_sum(y_RH.contiguous(), slot_row_TK.int().contiguous(), w)


class _ReorderRows(torch.autograd.Function):
    """Rows in a new order (a bijection); backward gathers through the inverse order.

    ``x.index_select(0, order)`` would be the same forward, but its backward is an atomic
    ``index_add_``, which for bf16 rows runs ~8x slower than the gather it replaces here (2x H200,
    EP2: 15.7 ms of a 70 ms step).
    """

    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse_R)
        return _gather_rows(x_RH, order_R)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # type: ignore[override]
        (inverse_R,) = ctx.saved_tensors
        return _gather_rows(grad_RH.contiguous(), inverse_R), None, None


def _gather_rows(x: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
    """``x[index_R]``: the row-gather kernel for ``[R, H]`` rows, ``index_select`` for anything else."""
    return _permute_rows_impl(x, index_R) if x.dim() == 2 else x.index_select(0, index_R)


def reorder_rows(x_RH: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
    """``x_RH[order_R]`` for a permutation ``order_R`` whose inverse is ``inverse_R``; differentiable.

    Both index tensors must be permutations of ``range(R)`` and each other's inverse (the caller
    builds them together); the gradient is then exactly the gather through ``inverse_R``.
    """
    if order_R.shape != (x_RH.shape[0],) or inverse_R.shape != order_R.shape:
        raise ValueError(
            f"reorder_rows needs one index per row: x has {x_RH.shape[0]} rows, order {tuple(order_R.shape)}, "
            f"inverse {tuple(inverse_R.shape)}."
        )
    return _ReorderRows.apply(x_RH, order_R, inverse_R)


def permute_rows(x_SH: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Rows of ``x_SH`` in expert order (``x_RH``); differentiable."""
    return _PermuteRows.apply(x_SH, perm)


def unpermute_sum(y_RH: torch.Tensor, perm: Permutation, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Rows back in token order, summed over the K slots (weighted when ``weights_TK``)."""
    return _UnpermuteSum.apply(y_RH, perm, weights_TK)
