"""torchmetrics Metrics for MoE load, each synchronised over the process group it is given.

Legend: L MoE layers, E experts, P ranks of an expert-parallel (EP) group.

Which group to give (the strategy decides; a metric never guesses):

* :class:`ExpertLoad` — tokens routed to every expert. Sum over the ranks that hold *different*
  tokens: the data-parallel x context-parallel group (``dp_cp``) under ``folded_moe``, the world
  under DDP (``process_group=None`` means the default group, as in torchmetrics).
* :class:`RankLoad` — rows each EP rank's experts process. Every rank adds the rows it *sends* to
  each EP rank; summed over the layer's EP group (``dispatcher.ep_group``) that is exactly what
  each EP rank receives.
* :class:`LayerMean` — a per-layer mean (dropped fraction, router entropy, an aux loss) over the
  same group as :class:`ExpertLoad`.

Load balance is summarised as ``max / mean`` along the last dimension (:func:`max_over_mean`):
1.0 is perfectly balanced, ``E`` (or ``P``) means one expert (rank) takes everything.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

__all__ = ["ExpertLoad", "LayerMean", "RankLoad", "max_over_mean", "rank_load_from_experts"]


def max_over_mean(load_LX: torch.Tensor) -> torch.Tensor:
    """``max / mean`` of each row ``[L, X] -> [L]``; 1.0 for a row with no load at all."""
    load_LX = load_LX.double()
    mean_L = load_LX.mean(-1)
    ratio_L = load_LX.amax(-1) / mean_L.clamp(min=1e-12)
    return torch.where(mean_L > 0, ratio_L, torch.ones_like(ratio_L)).float()


def rank_load_from_experts(tokens_LE: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``[L, E] -> [L, P]``: expert ``g`` lives on EP rank ``g // (E / P)``; sum each rank's experts."""
    L, E = tokens_LE.shape
    if E % ep_size:
        raise ValueError(f"rank_load_from_experts: ep_size={ep_size} must divide num_experts={E}.")
    return tokens_LE.reshape(L, ep_size, E // ep_size).sum(-1)


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name}={value!r} must be a positive int.")


class _LayerCountTable(Metric):
    """An int64 table ``[L, X]`` of per-layer counts, summed over updates and ranks.

    A subclass names its state (``_state``), what it counts (``_counted``), its columns (``_columns``)
    and the argument that sizes them (``_size_name``, kept as an attribute like ``num_layers``).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False
    _state: str
    _counted: str
    _columns: str
    _size_name: str

    def __init__(self, num_layers: int, num_columns: int, process_group: Any, **kwargs: Any) -> None:
        _check_positive(type(self).__name__, num_layers=num_layers, **{self._size_name: num_columns})
        super().__init__(process_group=process_group, **kwargs)
        self.num_layers = num_layers
        setattr(self, self._size_name, num_columns)
        zeros_LX = torch.zeros(num_layers, num_columns, dtype=torch.int64)
        self.add_state(self._state, default=zeros_LX, dist_reduce_fx="sum")

    def _table(self) -> torch.Tensor:
        return getattr(self, self._state)

    def update(self, counts_LX: torch.Tensor) -> None:
        table_LX = self._table()
        if tuple(counts_LX.shape) != tuple(table_LX.shape):
            raise ValueError(
                f"{type(self).__name__}: update got {self._counted} of shape {tuple(counts_LX.shape)}, expected "
                f"{tuple(table_LX.shape)} [layers, {self._columns}]."
            )
        table_LX += counts_LX.to(table_LX.device, torch.int64)

    def compute(self) -> torch.Tensor:
        return self._table().clone()


class ExpertLoad(_LayerCountTable):
    """Tokens routed to each expert of each layer ``[L, E]``, summed over updates and ranks.

    Args:
        num_layers: L.
        num_experts: E.
        process_group: ranks whose counts are summed at ``compute`` (see the module docstring);
            ``None`` is the default group.
    """

    _state, _counted, _columns, _size_name = "tokens_LE", "counts", "experts", "num_experts"
    num_experts: int

    def __init__(self, num_layers: int, num_experts: int, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(num_layers, num_experts, process_group, **kwargs)


class RankLoad(_LayerCountTable):
    """Rows processed by each EP rank of each layer ``[L, P]``.

    Every rank updates with the rows it sends to each EP rank; the sum over ``process_group``
    (the EP group) is then what every EP rank receives.
    """

    _state, _counted, _columns, _size_name = "rows_LP", "rows", "EP ranks", "ep_size"
    ep_size: int

    def __init__(self, num_layers: int, ep_size: int, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(num_layers, ep_size, process_group, **kwargs)


class LayerMean(Metric):
    """Mean of a per-layer scalar ``[L]`` over updates and ranks; layers never updated give 0."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, num_layers: int, process_group: Any = None, **kwargs: Any) -> None:
        _check_positive("LayerMean", num_layers=num_layers)
        super().__init__(process_group=process_group, **kwargs)
        self.num_layers = num_layers
        self.add_state("total_L", default=torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count_L", default=torch.zeros(num_layers, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values_L: torch.Tensor, present_L: torch.Tensor | None = None) -> None:
        """``present_L`` (bool) marks the layers that produced a value this time (all by default)."""
        if tuple(values_L.shape) != (self.num_layers,):
            raise ValueError(f"LayerMean: update got shape {tuple(values_L.shape)}, expected ({self.num_layers},).")
        mask_L = torch.ones_like(values_L, dtype=torch.bool) if present_L is None else present_L.bool()
        values_L = values_L.to(self.total_L.device, torch.float64)
        mask_L = mask_L.to(self.total_L.device)
        self.total_L += torch.where(mask_L, values_L, torch.zeros_like(values_L))
        self.count_L += mask_L.double()

    def compute(self) -> torch.Tensor:
        return (self.total_L / self.count_L.clamp(min=1)).float()
