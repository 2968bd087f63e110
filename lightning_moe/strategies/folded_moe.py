"""FoldedMoEStrategy: MoE parallel folding for the Lightning Trainer.

Attention and the other dense layers are laid out ``tp x cp x dp`` and the experts
``etp x ep x edp`` over the same ranks (DESIGN.md §5). The strategy is thin; its stages:

1. ``__init__``: typed degrees (checks that need no world: pp, order, positive ints);
2. ``setup_environment``: ``FoldedLayout`` for the world size and the model checks, *before*
   any collective; then init_process_group (WORLD) and ``FoldedMesh.build`` (new groups);
3. ``setup``: ``parallelize_moe_model`` unless ``configure_model`` already sharded the model
   (TP over ``tp``; experts as DTensors over ``ep``/``etp`` with an all-to-all dispatcher;
   FSDP2 over ``dp_cp`` and ``edp``), then Lightning's usual materialise / optimizers;
   gradient clipping (``gradient_clip_val``) is routed to the mesh-aware ``parallel.grad``;
4. training: ``block_backward_sync`` turns FSDP2 gradient sync off during accumulation;
   ``distributed_sampler_kwargs`` hands out DP rank/size; ``expert_bias_group`` is the
   ``dp_cp`` group the router counts are summed over;
5. checkpoints: Lightning's distributed (DCP) save/load; expert parameters are DTensors over
   ``(edp, ep[, etp])`` so every expert id is stored and a load reshards (EP4 -> EP2 -> EP1).
   Optimizer state (SGD momentum, AdamW moments and step) goes through the same DCP folder and
   comes back exactly: a run resumed from a checkpoint written at an optimizer-step boundary
   continues with the identical loss sequence. Accumulated gradients are not checkpointed (as in
   Lightning), and a plain ``DataLoader`` restarts an interrupted epoch from its first batch, so
   an exact resume needs a checkpoint at an epoch end or a resumable loader
   (``state_dict``/``load_state_dict``). Save from ``ModelCheckpoint`` (``on_train_batch_end``):
   a ``trainer.save_checkpoint`` after ``fit`` returned at ``max_steps`` on an epoch's last batch
   stores loop counters that make Lightning end the next epoch after its first batch.

Throughput: Lightning's ``ThroughputMonitor`` multiplies per-device samples by
``trainer.world_size``, but the ``tp*cp`` ranks of one data-parallel replica read the same
samples. Use :attr:`data_parallel_size` (e.g. count a batch as
``batch_size * data_parallel_size / world_size`` in its ``batch_size_fn``) to get global
samples/s; its FLOP numbers are per device and need no change.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_moe.parallel.grad import clip_grad_norm_, clip_grad_value_, set_gradient_sync
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import (
    DispatcherKind,
    check_model_for_layout,
    init_experts_by_id,
    parallelize_moe_model,
)
from lightning_moe.strategies.fabric import Degree, _check_args, _check_namespace, _folded_layout, _sampler_kwargs

__all__ = ["FoldedMoEStrategy"]


class FoldedMoEStrategy(ModelParallelStrategy):
    """Parallel folding for MoE models: TP/CP/DP for attention, ETP/EP/EDP for experts.

    Args:
        tp: tensor-parallel degree of attention and dense MLPs.
        cp: context-parallel degree (reserved; only 1 is implemented).
        ep: expert-parallel degree (must divide ``num_experts``).
        etp: expert tensor-parallel degree (must divide the expert FFN size and ``tp``).
        pp: pipeline-parallel degree; only 1 (pipeline parallel comes later).
        dp: data-parallel degree of the dense layers, ``"auto"`` = ``W/(tp*cp*pp)``.
        edp: data-parallel degree of the experts, ``"auto"`` = ``W/(etp*ep*pp)``.
        order: rank order, fastest first (Megatron-Core's ``RankGenerator``), e.g. ``"tp-cp-ep-dp-pp"``.
        dispatcher: token exchange over the EP group: ``"alltoall_dedup"`` (default: NCCL
            all-to-all sending each token once per destination rank), ``"alltoall"`` (one row per
            routed slot), ``"allgather"``, ``"deepep"`` or ``"hybridep"`` (the last two need the
            optional ``deep_ep`` package, and bf16).
        expert_init_seed: if set, experts are re-initialised per global expert id from this seed
            (layout-independent, every EP rank distinct); always done for meta-device init.
        save_distributed_checkpoint: DCP folder (sharded, reshardable) instead of one file.
    """

    strategy_name = "folded_moe"

    def __init__(
        self,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int = 1,
        pp: int = 1,
        dp: Degree = "auto",
        edp: Degree = "auto",
        order: str = "tp-cp-ep-dp-pp",
        dispatcher: DispatcherKind = "alltoall_dedup",
        expert_init_seed: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _check_args(type(self).__name__, tp, cp, ep, etp, pp, dp, edp, order, dispatcher)
        super().__init__(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tp, self.cp, self.ep, self.etp, self.pp = tp, cp, ep, etp, pp
        self.dp, self.edp, self.order, self.dispatcher = dp, edp, order, dispatcher
        self.expert_init_seed = expert_init_seed
        self._folded_mesh: FoldedMesh | None = None

    # ---- meshes ---------------------------------------------------------------------------------

    @property
    def folded_mesh(self) -> FoldedMesh:
        """Dense and expert meshes; raises ``RuntimeError`` before ``setup_environment``."""
        if self._folded_mesh is None:
            raise RuntimeError(
                "FoldedMoEStrategy: the folded mesh is built in setup_environment; read it from a hook that runs "
                "after the processes start (configure_model, setup, on_fit_start)."
            )
        return self._folded_mesh

    @property
    def expert_bias_group(self) -> Any:
        """Group the router's token counts are summed over (DP x CP); ``None`` with one data rank."""
        lay = self.folded_mesh.layout
        return self.folded_mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas of the dense layers (``dp``): the ranks that read
        different samples. ``world_size // data_parallel_size`` ranks (``tp*cp``) share each batch."""
        return self.folded_mesh.layout.dp

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return _sampler_kwargs(self.folded_mesh)

    def connect(self, model: pl.LightningModule) -> None:
        _check_namespace(model, type(self).__name__)
        super().connect(model)

    def setup_environment(self) -> None:
        owner = type(self).__name__
        world = self.num_nodes * self.num_processes
        layout = _folded_layout(owner, world, self.tp, self.cp, self.ep, self.etp, self.pp, self.dp, self.edp, self.order)
        if self.lightning_module is not None:
            check_model_for_layout(self.lightning_module, layout)
        # ModelParallelStrategy.setup_environment would build its own 2-D mesh: skip to the
        # process-group part of it, then build ours.
        self._setup_distributed()
        self._folded_mesh = FoldedMesh.build(layout, self.root_device.type)
        self._device_mesh = self._folded_mesh.dense

    # ---- model ----------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        already = any(isinstance(m, FSDPModule) for m in module.modules()) or any(
            isinstance(p, DTensor) for p in module.parameters()
        )
        had_meta = any(p.is_meta for p in module.parameters())
        if not already:
            parallelize_moe_model(module, mesh=self.folded_mesh, dispatcher=self.dispatcher)
        _materialize_distributed_module(self.model, self.root_device)
        if had_meta or self.expert_init_seed is not None:
            seed = self.expert_init_seed if self.expert_init_seed is not None else 0
            init_experts_by_id(module, self.folded_mesh, seed)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._install_mesh_aware_clipping()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _install_mesh_aware_clipping(self) -> None:
        """Route ``gradient_clip_val`` to ``parallel.grad``.

        Lightning's precision plugin clips with ``torch.nn.utils.clip_grad_norm_``, which fails for
        DTensors on two meshes; the plugin has no hook for it, so this strategy's plugin instance gets
        mesh-aware ``clip_grad_by_norm``/``clip_grad_by_value`` (the plugin still unscales first).
        """
        plugin = self.precision_plugin
        model = self.model

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            clip_grad_norm_(model.parameters(), float(clip_val))  # type: ignore[union-attr]

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
            clip_grad_value_(model.parameters(), float(clip_val))  # type: ignore[union-attr]

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's DCP load; the metadata file may hold our config dataclasses (hyperparameters),
        which ``torch.load(weights_only=True)`` accepts only when allow-listed — here, for this call."""
        from lightning_moe.config import MoEConfig
        from lightning_moe.models.transformer import TransformerConfig

        with torch.serialization.safe_globals([MoEConfig, TransformerConfig]):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @contextmanager
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
