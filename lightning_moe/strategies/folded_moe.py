"""FoldedMoEStrategy: MoE parallel folding for the Lightning Trainer.

Attention and the other dense layers are laid out ``tp x cp x dp`` and the experts
``etp x ep x edp`` over the same ranks. Degrees, layout, meshes, sharding, meta-device init and
expert seeding are :class:`~lightning_moe.strategies._core.FoldedMoECore`'s, shared with the
Fabric strategy; this class adds the Trainer's side. Its stages:

1. ``__init__``: typed degrees and options (checks that need no world: pp, order, positive ints,
   ``sequence_parallel``/``vocab_parallel`` need ``tp > 1``);
2. ``setup_environment``: ``FoldedLayout`` for the world size and the model checks, *before*
   any collective; then init_process_group (WORLD) and ``FoldedMesh.build`` (new groups);
3. ``setup``: ``parallelize_moe_model`` unless ``configure_model`` already sharded the model
   (TP over ``tp``; experts as DTensors over ``ep``/``etp`` with an all-to-all dispatcher;
   FSDP2 over ``dp_cp`` and ``edp``), materialisation of a model built on the meta device
   (``trainer.init_module(empty_init=True)``) with its experts seeded per EP rank, then
   Lightning's usual optimizers; ``self.device_mesh`` of a module deriving from
   ``MoELanguageModelBase`` (and ``trainer.strategy.device_mesh``) is the dense mesh from
   ``configure_model`` on;
   gradient clipping (``gradient_clip_val``) is routed to the mesh-aware ``parallel.grad``;
4. training: ``block_backward_sync`` turns FSDP2 gradient sync off during accumulation;
   ``distributed_sampler_kwargs`` hands out DP rank/size (the ``tp*cp`` ranks of a replica read
   the same samples); ``MoELanguageModelBase`` cuts each batch with :meth:`shard_batch` (with
   ``cp > 1`` this rank's load-balanced sequence chunks and their global positions; a length
   that is not a multiple of ``2*cp`` raises before any collective) and divides its loss by the
   labelled tokens over :attr:`loss_group` (``dp_cp``), so losses and gradients equal one
   process's; ``expert_bias_group`` is the group the router counts are summed over (``dp_cp``;
   the world with sequence parallel);
5. pipeline parallel (``pp > 1``, ``strategies/pipeline_setup.py`` and ``pipeline_step.py``): the
   transformer is cut into this rank's stages before ``parallelize``; ``MoELanguageModel``'s
   training step hands each batch to :attr:`pipeline`, whose schedule runs every micro-batch's
   forward and backward, so :meth:`backward` runs only the hooks around a backward; clipping
   takes the norm over every stage;
6. checkpoints (``lightning_moe.checkpoint``): a DCP folder written aside and published by
   rename (``last`` is always the newest complete checkpoint), with a manifest of sizes and
   CRC-32s verified before any weight changes; expert parameters are DTensors over
   ``(edp, ep[, etp])`` and ``w13`` is stored as its gate and up halves, so a load reshards to any
   layout, one process included. Optimizer state goes through the same folder and comes back
   exactly. Accumulated gradients are not checkpointed (as in Lightning); ``MoEDataModule``'s
   train loader saves its position, while a plain ``DataLoader`` restarts an interrupted epoch from
   its first batch. Save from ``ModelCheckpoint`` (``on_train_batch_end``): a
   ``trainer.save_checkpoint`` after ``fit`` returned at ``max_steps`` on an epoch's last batch
   stores loop counters that make Lightning end the next epoch after its first batch.

Throughput: Lightning's ``ThroughputMonitor`` multiplies per-device samples by
``trainer.world_size``, but the ``tp*cp`` ranks of one data-parallel replica read the same
samples. Use :attr:`data_parallel_size` (e.g. count a batch as
``batch_size * data_parallel_size / world_size`` in its ``batch_size_fn``) to get global
samples/s; its FLOP numbers are per device and need no change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.nn as nn
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_moe.checkpoint.atomic import remove
from lightning_moe.optimizer import unscale_before_step
from lightning_moe.parallel.finite import NonFiniteGuard
from lightning_moe.parallel.grad import set_gradient_sync
from lightning_moe.strategies._core import FoldedMoECore
from lightning_moe.strategies.checkpoint_io import (
    load_trainer_checkpoint,
    resume_last_or_newest_complete,
    save_trainer_checkpoint,
)
from lightning_moe.strategies.clipping import install_mesh_aware_clipping
from lightning_moe.strategies.guards import guarded_closure, nonfinite_guard_for
from lightning_moe.strategies.launcher import trainer_launcher_for
from lightning_moe.strategies.layout import check_namespace
from lightning_moe.strategies.pipeline_setup import check_pipeline_trainer

__all__ = ["FoldedMoEStrategy", "release_callback_logging"]


def release_callback_logging(callbacks: list[pl.Callback], module: pl.LightningModule | None) -> None:
    """Remove the ``log``/``log_dict`` methods of ``module`` that Lightning attached to ``callbacks``."""
    for callback in callbacks:
        for name in ("log", "log_dict"):
            method = callback.__dict__.get(name)
            if method is not None and getattr(method, "__self__", None) is module:
                del callback.__dict__[name]


class FoldedMoEStrategy(FoldedMoECore, ModelParallelStrategy):
    """Parallel folding for MoE models: TP/CP/DP for attention, ETP/EP/EDP for experts.

    Arguments as :class:`~lightning_moe.strategies._core.FoldedMoECore`: ``tp cp ep etp pp dp edp
    order dispatcher expert_init_seed save_distributed_checkpoint process_group_backend timeout
    rank_liveness_timeout_s guard_nonfinite skip_nonfinite sequence_parallel vocab_parallel``. The
    non-finite guard runs in :meth:`optimizer_step` for any LightningModule; the strategy owns its
    options (a module's deprecated ones are forwarded here).
    """

    _nonfinite_guard: NonFiniteGuard | None = None

    strategy_name = "folded_moe"
    _trainer_ref: weakref.ref[pl.Trainer] | None = None  # the Trainer of the last setup (teardown's callbacks)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = trainer_launcher_for(self)  # Lightning's, its child observer waiting for the watchdog

    @override
    def _module_to_check(self) -> nn.Module | None:
        return self.lightning_module

    @property
    @override
    def lightning_module(self) -> pl.LightningModule | None:
        module = super().lightning_module
        resume_last_or_newest_complete(module)  # read by the Trainer right before it resolves ckpt_path="last"
        return module

    @override
    def connect(self, model: pl.LightningModule) -> None:
        check_namespace(model, type(self).__name__)
        super().connect(model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Prepare the module (shard, materialise, seed), precision, optimizers, clipping and the guard."""
        if self.model is None or self.accelerator is None or self.lightning_module is None:
            raise RuntimeError(f"{type(self).__name__}: setup needs a connected model and accelerator; use a Trainer.")
        self._trainer_ref = weakref.ref(trainer)
        check_pipeline_trainer(type(self).__name__, self.pipeline_options, trainer)
        self.accelerator.setup(trainer)
        self.shard_module(self.lightning_module, root=self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                unscale_before_step(optimizer)  # fused optimizers clip under every precision plugin
        self.setup_precision_plugin()
        if isinstance(self.model, nn.Module):
            pp_group = self.folded_mesh.group("pp") if self.pipeline_options.pp > 1 else None
            install_mesh_aware_clipping(self.precision_plugin, self.model, pp_group)
        options = (self.guard_nonfinite, self.skip_nonfinite)
        self._nonfinite_guard = nonfinite_guard_for(type(self).__name__, options, self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: pl.LightningModule | nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's step with the non-finite guard after the closure's backward, before clipping."""
        guard, module = self._nonfinite_guard, self.lightning_module
        if guard is not None and module is not None:
            closure = guarded_closure(guard, closure, module, self.root_device, module.global_step, self.precision_plugin)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's backward, except at ``pp > 1``: there the training step's pipeline schedule
        has run every micro-batch's backward already (``strategies/pipeline_step.py``), so only
        the hooks around a backward run (``on_before_backward``, ``on_after_backward``)."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def _batch_size_to_check(self) -> int | None:
        """The data module's ``batch_size`` (an int), checked against the micro-batches before any group."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        size = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then the fit's references handed to callbacks are taken back.

        At the start of every fit Lightning gives each callback the module's ``log`` and
        ``log_dict`` as bound methods and never removes them, so a callback that outlives the
        Trainer (a timer, a monitor reused in the next fit) would keep the module, the Trainer,
        the optimizer state and the gradients alive: device memory that never comes back.
        """
        module = self.lightning_module
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        super().teardown()
        if trainer is not None:
            release_callback_logging(trainer.callbacks, module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Atomic save (``checkpoint_io.save_trainer_checkpoint``): a DCP folder with a manifest, or
        one file (``save_distributed_checkpoint=False``), written aside and published by rename."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}: save_checkpoint(storage_options=...) is not supported; drop it.")
        path = Path(self.broadcast(filepath))
        save_trainer_checkpoint(checkpoint, path, self.model, self.folded_mesh,  # type: ignore[arg-type]
                                distributed=self._save_distributed_checkpoint, rank=self.global_rank,
                                barrier=self.barrier)  # fmt: skip

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verified DCP load at any layout, or Lightning's one-file load (``checkpoint_io.load_trainer_checkpoint``)."""
        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        model = self.model if module is not None and isinstance(self.model, nn.Module) else None

        def load_file(file: Path) -> dict[str, Any]:
            return super(FoldedMoEStrategy, self).load_checkpoint(file, weights_only=weights_only)

        strict = module.strict_loading if module is not None else True
        return load_trainer_checkpoint(path, model, list(self.optimizers), strict=strict, rank=self.global_rank,
                                       broadcast=self.broadcast, weights_only=weights_only, load_file=load_file)  # fmt: skip

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No FSDP2 gradient reduction while accumulating (Lightning's version only knows DDP)."""
        model = self.model
        if not isinstance(model, nn.Module):
            yield
            return
        set_gradient_sync(model, False)
        try:
            yield
        finally:
            set_gradient_sync(model, True)
