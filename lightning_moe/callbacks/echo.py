"""ECHOExpertCloning: clone hot experts into spare slots of under-loaded EP ranks.

Legend: L MoE layers, E experts, P ranks of the expert-parallel (EP) group, S spare slots per rank.

Each EP rank reserves S spare expert slots per MoE layer. The result is the same loss and the
same gradients as without cloning (up to summation order), with a flatter load per EP rank.

Stages (every rank runs them in the same order; collectives over each layer's EP group):

1. ``on_train_start`` (after the strategy sharded the model): wrap every layer's dispatcher
   (``dispatcher="alltoall"`` or ``"alltoall_dedup"``) in an
   :class:`~lightning_moe.moe.dispatch.echo.EchoDispatcher` (no clones yet).
2. ``on_train_batch_end``: add each layer's routed counts (``last_tokens_per_expert``) to an
   ``[L, E]`` accumulator (no communication).
3. First micro-batch of every optimizer step: every ``interval`` steps, all-reduce(EP) the
   accumulated counts and run :func:`~lightning_moe.moe.dispatch.echo_plan.plan_clones` per layer (the
   same result on every EP rank); then A2A(EP) the home experts' current weights into the clone
   slots (``refresh_clones``) — after *every* optimizer step, so clones never lag.
4. ``on_before_optimizer_step`` (after all micro-batches' backward, before clipping and the
   step): A2A(EP) each clone's gradient back to its home rank, scaled like expert gradients, and
   add it to the home expert's gradient (``reduce_clone_grads``).
5. ``on_train_end`` / ``teardown``: put the original dispatchers back.

Clones are not state: their weights are plain tensors outside the module, so checkpoints never
contain them and a resumed run starts with no clones until the next plan.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_moe.callbacks._layers import require_moe_layers
from lightning_moe.moe.dispatch.echo import EchoDispatcher
from lightning_moe.moe.dispatch.echo_plan import plan_clones
from lightning_moe.moe.layer import MoELayer

__all__ = ["ECHOExpertCloning", "strategy_expert_grad_scale"]


def strategy_expert_grad_scale(trainer: L.Trainer) -> float:
    """The factor the strategy applies to expert gradients (``folded_moe``: ``EDP*ETP/(TP*CP*DP)``,
    ``EDP/(CP*DP)`` with ``sequence_parallel``)."""
    try:
        mesh = getattr(trainer.strategy, "folded_mesh", None)
    except RuntimeError:  # the mesh is not built yet
        mesh = None
    layout = getattr(mesh, "layout", None)
    if layout is None:
        return 1.0
    from lightning_moe.parallel.parallelize import applied_expert_grad_scale

    return applied_expert_grad_scale(layout, bool(getattr(trainer.strategy, "sequence_parallel", False)))


class ECHOExpertCloning(Callback):
    """Balance expert-parallel load by cloning hot experts into spare slots.

    Args:
        spare_slots_per_rank: S spare expert slots per EP rank and MoE layer.
        interval: plan clones every this many optimizer steps, from the counts routed since the
            last plan (the first plan is made at step ``interval``).
        tolerance: stop placing clones once the busiest rank is within ``1 + tolerance`` of the
            balanced share.
        grad_scale: factor applied to clone gradients before they join the home expert's
            gradient; ``None`` takes the strategy's expert gradient scale (``folded_moe``), or 1.
    """

    supports_pipeline_parallel = False  # acts on one forward and backward of the whole model

    def __init__(
        self,
        spare_slots_per_rank: int = 1,
        interval: int = 1,
        tolerance: float = 0.0,
        grad_scale: float | None = None,
    ) -> None:
        spare = spare_slots_per_rank
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 1:
            raise ValueError(
                f"ECHOExpertCloning: spare_slots_per_rank={spare_slots_per_rank} must be >= 1; "
                "remove the callback to turn cloning off."
            )
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"ECHOExpertCloning: interval={interval!r} must be >= 1 (optimizer steps).")
        if not tolerance >= 0 or tolerance == float("inf"):  # NaN fails every comparison
            raise ValueError(f"ECHOExpertCloning: tolerance={tolerance} must be >= 0 and finite; use e.g. 0.0.")
        if grad_scale is not None and not 0 < grad_scale < float("inf"):
            raise ValueError(
                f"ECHOExpertCloning: grad_scale={grad_scale} must be a finite number > 0, or None for the "
                "strategy's expert gradient scale."
            )
        self.spare_slots_per_rank = spare_slots_per_rank
        self.interval = interval
        self.tolerance = tolerance
        self.grad_scale = grad_scale
        self._layers: list[tuple[str, MoELayer]] = []
        self._echo: list[EchoDispatcher] = []
        self._counts_LE: torch.Tensor | None = None
        self._scale = 1.0
        self._step_seen: int | None = None
        self.plans_made = 0

    # --- Lightning hooks ------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._layers = require_moe_layers("ECHOExpertCloning", pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._layers = require_moe_layers("ECHOExpertCloning", pl_module)
        self._echo = []
        ep_sizes = {layer.dispatcher.ep_size for _, layer in self._layers}
        if ep_sizes == {1}:
            rank_zero_warn(
                "ECHOExpertCloning: the MoE layers are not expert-parallel (ep=1), so there is no rank load to "
                "balance and the callback does nothing; train with strategy='folded_moe' and ep > 1."
            )
            return
        for name, layer in self._layers:
            dispatcher = layer.dispatcher
            if isinstance(dispatcher, EchoDispatcher):
                dispatcher = dispatcher.base
            try:
                echo = EchoDispatcher(dispatcher, layer.experts, self.spare_slots_per_rank)
            except NotImplementedError as err:
                raise NotImplementedError(f"ECHOExpertCloning: layer {name!r}: {err}") from err
            layer.dispatcher = echo
            self._echo.append(echo)
        E = self._layers[0][1].config.num_experts
        self._counts_LE = torch.zeros(len(self._layers), E, dtype=torch.float64, device=pl_module.device)
        self._scale = self.grad_scale if self.grad_scale is not None else strategy_expert_grad_scale(trainer)
        self._step_seen = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._echo:
            return
        step = trainer.global_step
        if step == self._step_seen:
            return  # a later micro-batch of the same optimizer step
        self._step_seen = step
        if step > 0 and step % self.interval == 0:
            self._replan()
        for echo in self._echo:
            echo.refresh_clones()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._echo or self._counts_LE is None:
            return
        for i, (_, layer) in enumerate(self._layers):
            if layer.last_tokens_per_expert is not None:
                self._counts_LE[i] += layer.last_tokens_per_expert.to(self._counts_LE)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self._echo:
            return
        scale = self._scale
        # fp16 AMP: Lightning has already unscaled the optimizer's gradients, not the clones'.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale /= float(scaler.get_scale())  # SYNC: the loss scale, once per step
        for echo in self._echo:
            echo.reduce_clone_grads(scale)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    # --- internals ------------------------------------------------------------------------------

    def _replan(self) -> None:
        counts_LE = self._counts_LE
        assert counts_LE is not None
        # One all-reduce for every layer (all layers share one EP group under folded_moe).
        groups = {id(echo.ep_group): echo.ep_group for echo in self._echo}
        if len(groups) == 1:
            dist.all_reduce(counts_LE, group=self._echo[0].ep_group)
        else:
            for i, echo in enumerate(self._echo):
                dist.all_reduce(counts_LE[i], group=echo.ep_group)
        for i, echo in enumerate(self._echo):
            echo.plan = plan_clones(counts_LE[i], echo.ep_size, echo.spare_slots, self.tolerance)
        counts_LE.zero_()
        self.plans_made += 1

    def _restore(self) -> None:
        for (_, layer), echo in zip(self._layers, self._echo):
            if layer.dispatcher is echo:
                layer.dispatcher = echo.base
        self._echo = []

    @property
    def active_clones(self) -> list[int]:
        """Clones placed in each wrapped layer by the current plan (0 before the first plan)."""
        return [0 if echo.plan is None else echo.plan.num_clones for echo in self._echo]
