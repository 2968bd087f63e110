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
5. context parallel (``cp > 1``): the loop cuts each batch with ``fabric.strategy.shard_batch``
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

from lightning_moe.checkpoint.dcp import save_staged, verified_manifest
from lightning_moe.checkpoint.manifest import CheckpointError
from lightning_moe.optimizer import unscale_before_step
from lightning_moe.strategies._core import FoldedMoECore, mesh_aware_clip_norm, mesh_aware_clip_value

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

    @override
    def _lightning_init_args(self) -> tuple[Any, ...]:
        # Fabric's ModelParallelStrategy takes a parallelize function; setup_module below replaces
        # the only place that calls it.
        return (self._parallelize,)

    def _parallelize(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return self.shard_module(module, shard_root=True)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard, materialise (meta-device modules) and seed the experts; the root is sharded too."""
        return self.shard_module(module, shard_root=True)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers``: a fused optimizer clips under every precision plugin."""
        return unscale_before_step(super().setup_optimizer(optimizer))

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: shard the model, then re-point the optimizers.

        TP and FSDP2 replace every parameter by a DTensor parameter of the same name, so an
        optimizer made before ``setup`` would step the old tensors; its parameter groups are
        rebuilt by name (it must not have stepped yet).
        """
        owner = type(self).__name__
        names = {id(p): n for n, p in module.named_parameters()}
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    f"{owner}: {type(optimizer).__name__} already has state for {len(optimizer.state)} parameters; "
                    "pass an optimizer that has not stepped, or call fabric.setup(model) first and build the "
                    "optimizer from the returned model's parameters."
                )
            unknown = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
            if unknown:
                raise ValueError(
                    f"{owner}: {type(optimizer).__name__} holds {unknown} parameters that are not the model's; "
                    "build it from model.parameters()."
                )
        module = self.setup_module(module)
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            unscale_before_step(optimizer)  # fused optimizers clip under every precision plugin
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return module, optimizers, scheduler

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Lightning's save, written aside and published by rename (``lightning_moe.checkpoint``); a
        DCP folder gets a manifest of sizes and checksums. Its ``w13`` keeps the saved ETP layout."""
        path = Path(self.broadcast(path))
        etp = self.folded_mesh.layout.etp

        def write(staged: Path) -> None:
            super(FabricFoldedMoEStrategy, self).save_checkpoint(staged, state, storage_options, filter)

        save_staged(path, write, rank=self.global_rank, barrier=self.barrier, manifest={"layout": {"etp": etp}})

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A DCP folder is verified against its manifest (rank 0, before anything loads), then
        Lightning's load; a folder saved at another ETP degree is refused, naming both."""
        path = Path(self.broadcast(path))
        if path.is_dir():
            manifest = verified_manifest(path, self.global_rank, self.broadcast) or {}
            saved, here = manifest.get("layout", {}).get("etp"), self.folded_mesh.layout.etp
            if saved is not None and saved != here:
                raise CheckpointError(
                    f"{type(self).__name__}: checkpoint {str(path)!r} holds w13 at etp={saved}, this run has "
                    f"etp={here}; load it at etp={saved}."
                )
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
        return mesh_aware_clip_norm(module, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        mesh_aware_clip_value(module, float(clip_val))
