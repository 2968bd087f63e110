"""FabricFoldedMoEStrategy: MoE parallel folding for ``lightning.Fabric``.

Degrees, layout, meshes, sampler arguments, sharding, meta-device init and expert seeding are
:class:`~lightning_moe.strategies._core.FoldedMoECore`'s, shared with the Trainer's
:class:`~lightning_moe.strategies.folded_moe.FoldedMoEStrategy`; this class adds Fabric's side:

1. ``fabric.launch()`` runs ``setup_environment``: the layout checks before any collective, then
   WORLD and the folded mesh (``fabric.strategy.device_mesh`` is the dense mesh from then on);
2. ``fabric.setup(module)``: ``shard_module`` with the root FSDP-sharded too; a module built under
   ``fabric.init_module(empty_init=True)`` is materialised after sharding and its experts are
   seeded per global expert id, as under the Trainer;
3. ``fabric.setup(module, optimizer)``: the optimizer is re-pointed at the sharded parameters;
4. ``fabric.no_backward_sync`` turns FSDP2's gradient reduction off during accumulation (Lightning's
   ``ModelParallelStrategy`` behaviour), and ``fabric.clip_gradients`` is mesh-aware;
5. the non-finite guard (``guard_nonfinite``, ``skip_nonfinite``) runs in :meth:`optimizer_step`,
   which the optimizer returned by ``fabric.setup`` calls from ``.step()``: the losses given to
   ``fabric.backward`` since the last step and the gradients of the set-up module are checked
   before the optimizer reads them, with the Trainer's semantics (``FloatingPointError`` naming the
   first bad parameter, or the step skipped with a warning up to ``skip_nonfinite`` in a row);
6. pipeline parallel (``pp > 1``): ``fabric.setup(transformer)`` returns this rank's stages
   (``LocalStages``, the transformer's parameter names; also ``fabric.strategy.pipeline.stages``,
   while the wrapper's ``.module`` stays the uncut transformer; a swapped Hugging Face causal LM
   given instead is cut into ``HFLocalStages``), and the loop calls
   ``loss = fabric.strategy.pipeline_step(batch, accumulate)`` in place of the forward and
   ``fabric.backward`` (the schedule runs both); ``fabric.no_backward_sync``,
   ``fabric.clip_gradients`` (the norm over every stage) and the guard work as at ``pp = 1``;
   validation: ``fabric.strategy.pipeline.eval_step(batch)`` (forward only, the same loss); both
   take the whole batch, packed-document ids included, and cut it for context parallel themselves
   (no ``shard_batch`` in the loop at ``pp > 1``);
7. context parallel (``cp > 1``): the loop cuts each batch with ``fabric.strategy.shard_batch``
   and takes the loss from ``parallel.fold_batch.lm_token_mean_loss`` over
   ``fabric.strategy.loss_group``, as the Trainer's LightningModule does::

       batch = fabric.strategy.shard_batch(batch)
       logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
       group, ranks = fabric.strategy.loss_group
       loss = lm_token_mean_loss(model, logits, batch["labels"], group, ranks)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe.optimizer import unscale_before_step
from lightning_moe.parallel.finite import NonFiniteGuard, forward_nonfinite_options
from lightning_moe.strategies._core import FoldedMoECore
from lightning_moe.strategies.checkpoint_io import check_fabric_checkpoint, save_fabric_checkpoint
from lightning_moe.strategies.clipping import mesh_aware_clip_norm, mesh_aware_clip_value
from lightning_moe.strategies.guards import FabricStepGuard
from lightning_moe.strategies.launcher import fabric_launcher_for
from lightning_moe.strategies.optimizers import check_unstepped_optimizers, parameter_names, repoint_optimizers
from lightning_moe.strategies.sharding import check_module_to_shard

__all__ = ["FabricFoldedMoEStrategy"]


class FabricFoldedMoEStrategy(FoldedMoECore, ModelParallelStrategy):
    """Fabric twin of :class:`~lightning_moe.strategies.folded_moe.FoldedMoEStrategy`.

    ``fabric.setup(module)`` shards the module with ``parallelize_moe_model`` (the root is
    FSDP-sharded too); build the optimizer from the returned module and pass it to
    ``fabric.setup_optimizers``, or hand a fresh optimizer to ``fabric.setup(module, optimizer)``,
    which re-points it at the sharded parameters. Arguments as
    :class:`~lightning_moe.strategies._core.FoldedMoECore`.
    """

    strategy_name = "folded_moe"
    _step_guard: FabricStepGuard | None = None

    @override
    def _configure_launcher(self) -> None:
        self._launcher = fabric_launcher_for(self)  # Lightning's, its child observer waiting for the watchdog

    @override
    def _lightning_init_args(self) -> tuple[Any, ...]:
        return (self._parallelize,)  # Lightning's parallelize_fn, called by its setup_module

    def _parallelize(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        """Lightning's ``parallelize_fn``: every step of ``prepare_module`` on the folded mesh (the
        dense ``device_mesh`` it passes is part of it); the root is FSDP-sharded too."""
        return self.shard_module(module, shard_root=True)

    @property
    def step_guard(self) -> FabricStepGuard | None:
        """The non-finite guard of this strategy's optimizer steps (``None`` with ``guard_nonfinite=False``)."""
        if self._step_guard is None and self.guard_nonfinite:
            self._step_guard = FabricStepGuard(NonFiniteGuard(type(self).__name__, self.skip_nonfinite))
        return self._step_guard

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Lightning's ``setup_module`` (``parallelize_fn``, then its materialisation, which finds
        nothing left on meta: ``prepare_module`` materialises before it seeds the experts).

        Kept as an override for two reasons: Lightning refuses FSDP1 modules before calling
        ``parallelize_fn`` with a message that names neither this strategy nor the module, so our
        check runs first; and the non-finite guard needs the set-up module's parameter names (a
        ``MoELanguageModelBase``'s deprecated guard options are forwarded here, as under the Trainer).
        """
        check_module_to_shard(type(self).__name__, module)
        forwarded = getattr(module, "forwarded_nonfinite_options", None)
        if forwarded:
            options = (self.guard_nonfinite, self.skip_nonfinite)
            owner, source = type(self).__name__, type(module).__name__
            self.guard_nonfinite, self.skip_nonfinite = forward_nonfinite_options(owner, options, source, forwarded)
            if self._step_guard is not None:
                self._step_guard.guard.skip_nonfinite = self.skip_nonfinite
                self._step_guard = self._step_guard if self.guard_nonfinite else None
        module = super().setup_module(module)
        if self.step_guard is not None:
            self.step_guard.watch(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers``: a fused optimizer clips under every precision plugin."""
        return unscale_before_step(super().setup_optimizer(optimizer))

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: shard the model, then re-point the optimizers by
        parameter name (``optimizers.py``; they must not have stepped yet)."""
        names = parameter_names(module)
        check_unstepped_optimizers(type(self).__name__, optimizers, names)
        module = self.setup_module(module)
        repoint_optimizers(optimizers, names, module)
        return module, optimizers, scheduler

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward; the loss is kept for the non-finite guard of the next step."""
        if self.step_guard is not None:
            self.step_guard.record_loss(tensor)
        super().backward(tensor, module, *args, **kwargs)

    def pipeline_step(self, batch: dict[str, torch.Tensor], accumulate: int = 1) -> torch.Tensor:
        """At ``pp > 1``, in place of the forward and ``fabric.backward``: every micro-batch of
        ``batch`` forward and backward through the pipeline schedule (``strategies/pipeline_step.py``),
        gradients scaled for ``accumulate`` batches per optimizer step; returns the detached loss
        one process would compute (the token mean, the same on every stage). The loss is kept for
        the non-finite guard of the next step, as ``fabric.backward`` keeps it."""
        if self.pipeline is None:
            raise ValueError(
                f"{type(self).__name__}: pipeline_step needs pp > 1 and a module set up with fabric.setup (pp="
                f"{self.pipeline_options.pp}); at pp=1 run the forward and fabric.backward(loss) instead."
            )
        loss = self.pipeline.train_step(batch, accumulate)
        if self.step_guard is not None:
            self.step_guard.record_loss(loss)
        return loss

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The non-finite guard (before the optimizer reads a gradient), then Lightning's step."""
        if self.step_guard is not None:
            kwargs = self.step_guard.before_step(optimizer, self.root_device, self.precision, kwargs)
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Lightning's save, written aside and published by rename (``checkpoint_io``); a DCP folder
        gets a manifest of sizes and checksums. Its ``w13`` keeps the saved ETP layout."""
        path = Path(self.broadcast(path))

        def write(staged: Path) -> None:
            super(FabricFoldedMoEStrategy, self).save_checkpoint(staged, state, storage_options, filter)

        save_fabric_checkpoint(path, write, self.folded_mesh, rank=self.global_rank, barrier=self.barrier)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A DCP folder is verified against its manifest (rank 0, before anything loads), then
        Lightning's load; a folder saved at another ETP degree is refused, naming both."""
        path = Path(self.broadcast(path))
        check_fabric_checkpoint(type(self).__name__, path, self.folded_mesh, rank=self.global_rank,
                                broadcast=self.broadcast)  # fmt: skip
        return super().load_checkpoint(path, state, strict, weights_only)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        pp_group = self.folded_mesh.group("pp") if self.pipeline_options.pp > 1 else None
        return mesh_aware_clip_norm(module, float(max_norm), float(norm_type), error_if_nonfinite, pp_group)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        mesh_aware_clip_value(module, float(clip_val))
