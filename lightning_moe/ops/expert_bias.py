"""Per-expert biases of rows grouped by expert: the rows' bias values and the biases' gradients.

Legend: R rows grouped by expert, E local experts, O a projection's output width.

The experts' GEMMs run without bias; the bias is added to their output row by row: row ``r`` of
expert ``e`` gets ``b_EO[e]``. Rows past the last group (padding some exchanges append) get none.
Everything here is free of host synchronisation (the expert of each row comes from a search of
the offsets on the device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bias_grad", "bias_rows", "down_bias_grads", "expert_of_rows", "placed_columns"]


def expert_of_rows(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The local expert of each row (int64 ``[R]``), from the inclusive row offsets ``offs_E``;
    ``E`` for rows past the last group."""
    rows_R = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows_R, right=True)


def bias_rows(b_EO: torch.Tensor, expert_R: torch.Tensor) -> torch.Tensor:
    """``[R, O]``: each row's expert bias, zeros for rows past the last group (no autograd)."""
    padded_EO = torch.cat([b_EO, b_EO.new_zeros(1, b_EO.shape[-1])])
    return padded_EO[expert_R]


def bias_grad(grad_RO: torch.Tensor, expert_R: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """``grad_b[e] = sum of grad_RO's rows of expert e`` (fp32 sums), in ``dtype``."""
    sums_EO = grad_RO.new_zeros(num_experts + 1, grad_RO.shape[-1], dtype=torch.float32)
    sums_EO.index_add_(0, expert_R, grad_RO.float())
    return sums_EO[:num_experts].to(dtype)


def down_bias_grads(
    grad_y_RH: torch.Tensor,
    w_R: torch.Tensor | None,
    b2_EH: torch.Tensor | None,
    expert_R: torch.Tensor | None,
    need_bias: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_b2, grad_w_R of the bias term)`` of ``y_RH = ... + w_R * b2[expert of the row]``
    (``w_R`` ``None``: weight 1); ``None`` for each one not needed."""
    if b2_EH is None:
        return None, None
    grad_b2 = None
    if need_bias:
        weighted_RH = grad_y_RH if w_R is None else grad_y_RH.float() * w_R.float().unsqueeze(-1)
        grad_b2 = bias_grad(weighted_RH, expert_R, b2_EH.shape[0], b2_EH.dtype)
    grad_w_R = None
    if w_R is not None and need_weight:
        grad_w_R = (grad_y_RH.float() * bias_rows(b2_EH, expert_R).float()).sum(-1)
    return grad_b2, grad_w_R


def placed_columns(b_Eo: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """``b_Eo`` (a column slice of a wider bias) at columns ``offset:offset + o`` of zeros ``[E, width]``;
    differentiable. Under expert tensor parallelism each rank holds one slice of the down bias and
    adds it to its slice of the columns only, so that the ranks' partial outputs sum to one bias."""
    if offset == 0 and b_Eo.shape[-1] == width:
        return b_Eo
    return F.pad(b_Eo, (offset, width - offset - b_Eo.shape[-1]))
