"""The MoE statistics of one pipeline step over the whole model: every stage, every micro-batch.

Legend: E experts of a layer, n micro-batches of a batch.

At ``pp > 1`` a rank runs only its own stages' MoE layers, once per micro-batch, and a layer's
``last_*`` attributes keep its last micro-batch only. :class:`PipelineMoEStats` keeps a tally:
after each forward of a stage view (a forward hook on the view) it adds each of that stage's MoE
layers' routed tokens per expert and aux losses. Activation recompute re-runs blocks inside the
backward, never the view, so no micro-batch is counted twice. :meth:`PipelineMoEStats.reduce`
sums the tallies of the pipeline group into the whole model's numbers with one all-reduce of one
flat fp64 tensor. The layout of that tensor (every MoE layer of the model, its ``E``, the aux-loss
keys) is agreed once by an ``all_gather_object`` on the first call:

* ``tokens[name]`` ``[E]``: tokens routed to each expert of layer ``name`` over the batch, its
  micro-batches summed: the counts one forward over the whole batch gives, because counts add;
* ``aux[key]``: the sum over every MoE layer of the mean over the micro-batches of that layer's
  ``key`` loss, as one process running the same micro-batches logs on average.

Every rank of the pipeline group gets the same numbers; each data rank's are those of its own
batch, as at ``pp = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_moe.moe.layer import MoELayer

__all__ = ["PipelineMoEStats", "StepMoEStats"]


@dataclass
class StepMoEStats:
    """One step's MoE statistics of the whole model (module docstring)."""

    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _LayerTally:
    layer: MoELayer
    tokens_E: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    forwards: int = 0


@dataclass(frozen=True)
class _Layout:
    """Where each layer's counts and each aux key sit in the flat tensor of the pipeline group."""

    layers: tuple[tuple[str, int, int], ...]  # (name, offset, E), in the model's order
    keys: tuple[str, ...]  # aux-loss keys; their sums follow the counts

    @property
    def size(self) -> int:
        return sum(e for _, _, e in self.layers) + len(self.keys)


class PipelineMoEStats:
    """A tally of the MoE layers of this rank's stages, and its sum over the pipeline group.

    Args:
        views: ``(stage_index, stage module)`` of this rank; each view's MoE layers are found by
            name relative to ``root``.
        root: the module whose qualified names the layers are reported under (``LocalStages``: the
            model's names).
        pp_group: the pipeline group (``None``: one rank).
        device: where the flat tensor of :meth:`reduce` lives (the stages' device).
    """

    def __init__(self, views: list[tuple[int, nn.Module]], root: nn.Module, pp_group: Any, device: torch.device) -> None:
        self.pp_group, self.device = pp_group, device
        layer_names = {id(m): name for name, m in root.named_modules() if isinstance(m, MoELayer)}
        self._tallies = {name: _LayerTally(m) for name, m in root.named_modules() if isinstance(m, MoELayer)}
        self._layout: _Layout | None = None
        self.collecting = False
        for _, view in views:
            names = [layer_names[id(m)] for m in view.modules() if isinstance(m, MoELayer)]
            view.register_forward_hook(self._hook(names))

    def _hook(self, names: list[str]) -> Any:
        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            if self.collecting:
                for name in names:
                    self._add(self._tallies[name])

        return after_forward

    @torch.no_grad()
    def _add(self, tally: _LayerTally) -> None:
        counts_E = tally.layer.last_tokens_per_expert
        if counts_E is not None:
            counts_E = counts_E.detach().to(torch.float64)
            tally.tokens_E = counts_E if tally.tokens_E is None else tally.tokens_E + counts_E
        for key, value in tally.layer.last_aux_losses.items():
            value = value.detach().to(torch.float64)
            tally.aux[key] = tally.aux[key] + value if key in tally.aux else value
        tally.forwards += 1

    def start(self) -> None:
        """Forget the last step's tally and count the forwards that follow."""
        for tally in self._tallies.values():
            tally.tokens_E, tally.aux, tally.forwards = None, {}, 0
        self.collecting = True

    def stop(self) -> None:
        self.collecting = False

    def reduce(self) -> StepMoEStats:
        """The whole model's statistics of the tallied training step (collective over the pipeline
        group: every rank of it calls this once per step). Every aux key of the model is present."""
        layout = self._layout or self._agree_layout()
        flat = torch.zeros(layout.size, dtype=torch.float64, device=self.device)
        key_base = layout.size - len(layout.keys)
        for name, offset, experts in layout.layers:
            tally = self._tallies.get(name)
            if tally is None or tally.forwards == 0:
                continue
            if tally.tokens_E is not None:
                flat[offset : offset + experts] = tally.tokens_E.to(self.device)
            for key, total in tally.aux.items():
                flat[key_base + layout.keys.index(key)] += total.to(self.device) / tally.forwards
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(flat, group=self.pp_group)
        aux = {key: flat[key_base + i].float() for i, key in enumerate(layout.keys)}
        tokens = {name: flat[offset : offset + experts] for name, offset, experts in layout.layers}
        return StepMoEStats(aux=aux, tokens=tokens)

    def _agree_layout(self) -> _Layout:
        """Every MoE layer of the model and every aux key, from one ``all_gather_object``."""
        mine = [
            (getattr(t.layer, "global_moe_index", i), name, t.layer.config.num_experts, t.layer.aux_loss_names())
            for i, (name, t) in enumerate(self._tallies.items())
        ]
        gathered = [mine]
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            gathered = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, mine, group=self.pp_group)
        entries = sorted({entry[:3]: entry[3] for part in gathered for entry in part}.items())
        layers, offset = [], 0
        for (_, name, experts), _keys in entries:
            layers.append((name, offset, experts))
            offset += experts
        keys = tuple(sorted({k for _, keys in entries for k in keys}))
        self._layout = _Layout(tuple(layers), keys)
        return self._layout
