"""The expert-tensor-parallel (ETP) step every expert-parallel dispatcher ends ``dispatch`` with,
and the step its ``combine`` starts with.

Without ETP nothing happens. With ETP the rows are identical over the group (tensor-parallel
replicas): ``copy_to_group`` marks them so (backward all-reduces their gradient). With
``sequence_parallel`` the ETP ranks hold different tokens: the rows (FP8 rows packed, when there
are any) are all-gathered over ETP expert-major, and ``combine`` reduce-scatters the partial outputs
back to their owners instead of all-reducing them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.comm import (
    ExpertRowsLayout,
    copy_to_group,
    gather_expert_rows,
    reduce_from_group,
    scatter_expert_rows,
)
from lightning_moe.moe.dispatch.fp8_rows import gather_expert_fp8_rows

__all__ = ["collect_from_etp", "share_over_etp"]


def share_over_etp(
    x_RH: torch.Tensor,
    x_fp8: Any,
    w_R: torch.Tensor,
    tokens_per_expert_e: torch.Tensor,
    etp_group: ProcessGroup | None,
    sequence_parallel: bool,
) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, ExpertRowsLayout | None]:
    """The rows, FP8 rows, weights and per-expert counts the ETP ranks compute on, and the layout
    ``collect_from_etp`` undoes (``None`` unless the rows were all-gathered)."""
    if etp_group is None:
        return x_RH, x_fp8, w_R, tokens_per_expert_e, None
    if sequence_parallel and x_fp8 is not None:
        return gather_expert_fp8_rows(x_RH, x_fp8, w_R, tokens_per_expert_e, etp_group)
    if sequence_parallel:
        x_RH, w_R, tokens_per_expert_e, etp_rows = gather_expert_rows(x_RH, w_R, tokens_per_expert_e, etp_group)
        return x_RH, x_fp8, w_R, tokens_per_expert_e, etp_rows
    return copy_to_group(x_RH, etp_group), x_fp8, copy_to_group(w_R, etp_group), tokens_per_expert_e, None


def collect_from_etp(y_RH: torch.Tensor, etp_rows: ExpertRowsLayout | None, etp_group: ProcessGroup | None) -> torch.Tensor:
    """The experts' outputs summed over the ETP group's F slices, for this rank's own rows."""
    if etp_rows is not None:
        return scatter_expert_rows(y_RH, etp_rows)
    if etp_group is not None:
        return reduce_from_group(y_RH, etp_group)
    return y_RH
