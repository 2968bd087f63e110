"""FabricFoldedMoEStrategy, and the helpers it shares with the Trainer's FoldedMoEStrategy.

The Trainer and Fabric strategies are thin: they validate the layout before any collective,
build a :class:`~lightning_moe.parallel.mesh.FoldedMesh`, and delegate the sharding to
:func:`~lightning_moe.parallel.parallelize.parallelize_moe_model` and the gradient work to
``parallel/grad.py``. The shared steps live here as private functions (as Lightning shares
``_setup_device_mesh`` between its two ModelParallelStrategy classes).

Stages of ``setup_environment`` (both strategies):

1. ``_folded_layout``: ``FoldedLayout(world_size, tp, cp, ep, etp, pp, order)`` plus the
   dp/edp checks and the model checks (num_experts % ep, ffn % etp, heads % tp) — no collective;
2. ``init_process_group`` (WORLD, gloo on CPU / nccl on GPU);
3. ``FoldedMesh.build``: the dense and expert DeviceMeshes (new groups over WORLD).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy as FabricModelParallelStrategy
from torch.optim import Optimizer

from lightning_moe.parallel.grad import clip_grad_norm_, clip_grad_value_
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import (
    DispatcherKind,
    check_dispatcher,
    check_model_for_layout,
    parallelize_moe_model,
)

__all__ = ["FabricFoldedMoEStrategy"]

Degree = Literal["auto"] | int


def _check_namespace(obj: Any, owner: str) -> None:
    """Raise if ``obj`` comes from the ``pytorch_lightning`` package (separate registries/classes)."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "pytorch_lightning":
            raise TypeError(
                f"{owner}: got {cls.__module__}.{cls.__name__} from the `pytorch_lightning` namespace; lightning-moe "
                "supports the `lightning` namespace only: use `import lightning.pytorch as pl` (and `lightning.Fabric`)."
            )


def _check_args(
    owner: str, tp: int, cp: int, ep: int, etp: int, pp: int, dp: Degree, edp: Degree, order: str, dispatcher: str
) -> None:
    """Checks that need no world size (constructor time)."""
    check_dispatcher(dispatcher, owner)
    if pp != 1 and isinstance(pp, int) and pp > 1:
        raise ValueError(f"{owner}: pp={pp} is not supported; pipeline parallel comes later; set pp=1.")
    if cp != 1 and isinstance(cp, int) and cp > 1:
        raise ValueError(f"{owner}: cp={cp} is not supported yet; context parallel comes later; set cp=1.")
    for name, value in (("dp", dp), ("edp", edp)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name}={value!r} must be 'auto' or a positive int.")
    # Order tokens and positive degrees are checked by FoldedLayout with a world that always divides.
    world = tp * cp * ep * etp * pp if all(isinstance(d, int) and d > 0 for d in (tp, cp, ep, etp, pp)) else 1
    FoldedLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)


def _folded_layout(
    owner: str, world_size: int, tp: int, cp: int, ep: int, etp: int, pp: int, dp: Degree, edp: Degree, order: str
) -> FoldedLayout:
    """The layout for ``world_size`` ranks; raises ``ValueError`` before any collective."""
    layout = FoldedLayout(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    if dp != "auto" and dp != layout.dp:
        raise ValueError(
            f"{owner}: dp={dp} but world_size={world_size} / (tp={tp} * cp={cp} * pp={pp}) = {layout.dp}; "
            f"set dp='auto' or dp={layout.dp}."
        )
    if edp != "auto" and edp != layout.edp:
        raise ValueError(
            f"{owner}: edp={edp} but world_size={world_size} / (etp={etp} * ep={ep} * pp={pp}) = {layout.edp}; "
            f"set edp='auto' or edp={layout.edp}."
        )
    return layout


def _sampler_kwargs(mesh: FoldedMesh) -> dict[str, int]:
    """Data-parallel rank and size: tensor/context-parallel ranks of one DP rank read the same batch."""
    return {"num_replicas": mesh.layout.dp, "rank": mesh.rank("dp")}


class FabricFoldedMoEStrategy(FabricModelParallelStrategy):
    """Fabric twin of :class:`~lightning_moe.strategies.folded_moe.FoldedMoEStrategy`.

    ``fabric.setup(module)`` shards the module with ``parallelize_moe_model`` (the root is
    FSDP-sharded too); build the optimizer from the returned module and pass it to
    ``fabric.setup_optimizers``, or hand a fresh optimizer to ``fabric.setup(module, optimizer)``,
    which re-points it at the sharded parameters. ``fabric.no_backward_sync`` turns FSDP2's
    gradient reduction off during accumulation, and ``fabric.clip_gradients`` is mesh-aware.
    Arguments as the Trainer strategy.
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
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _check_args(type(self).__name__, tp, cp, ep, etp, pp, dp, edp, order, dispatcher)
        super().__init__(
            self._parallelize,
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.tp, self.cp, self.ep, self.etp, self.pp = tp, cp, ep, etp, pp
        self.dp, self.edp, self.order, self.dispatcher = dp, edp, order, dispatcher
        self._folded_mesh: FoldedMesh | None = None

    @property
    def folded_mesh(self) -> FoldedMesh:
        if self._folded_mesh is None:
            raise RuntimeError(f"{type(self).__name__}: the folded mesh is built in setup_environment; launch first.")
        return self._folded_mesh

    @property
    def expert_bias_group(self) -> Any:
        """Group over which routed-token counts are summed (DP x CP), ``None`` on one data rank."""
        lay = self.folded_mesh.layout
        return self.folded_mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None

    def setup_environment(self) -> None:
        layout = _folded_layout(
            type(self).__name__, self.num_nodes * self.num_processes, self.tp, self.cp, self.ep, self.etp,
            self.pp, self.dp, self.edp, self.order,
        )  # fmt: skip
        self._layout = layout
        super(FabricModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self._folded_mesh = FoldedMesh.build(layout, self.root_device.type)
        self._device_mesh = self._folded_mesh.dense

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas (``dp``); ``tp*cp`` ranks share each batch."""
        return self.folded_mesh.layout.dp

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return _sampler_kwargs(self.folded_mesh)

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
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return module, optimizers, scheduler

    def _parallelize(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _check_namespace(module, type(self).__name__)
        check_model_for_layout(module, self.folded_mesh.layout)
        return parallelize_moe_model(module, mesh=self.folded_mesh, dispatcher=self.dispatcher, shard_root=True)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(module.parameters(), float(max_norm), float(norm_type), error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(module.parameters(), float(clip_val))
