"""The strategy core that ``FoldedMoEStrategy`` (Trainer) and ``FabricFoldedMoEStrategy`` share.

Both strategies are :class:`FoldedMoECore` placed before Lightning's ``ModelParallelStrategy``
of their side (``class FoldedMoEStrategy(FoldedMoECore, ModelParallelStrategy)``), as Lightning's
two ``ModelParallelStrategy`` classes share ``_setup_device_mesh``. The core holds everything that
does not depend on Trainer or Fabric:

1. ``__init__``: typed degrees and options and the checks that need no world size (pp, order,
   positive ints, the dispatcher name, ``sequence_parallel``/``vocab_parallel`` need ``tp > 1``),
   then the Lightning strategy's own constructor;
2. ``setup_environment``: :func:`folded_layout` for the world size and the model checks (num_experts
   % ep, ffn % etp, heads % tp; with ``cp > 1`` no ``aux_loss="seq"``) *before* any collective;
   then the accelerator's device, the default
   process group (WORLD: gloo on CPU, nccl on GPU) and :meth:`FoldedMesh.build` (new groups);
3. meshes: :attr:`folded_mesh` (dense and expert views), :attr:`device_mesh` (the dense mesh, as
   Lightning's ``ModelParallelStrategy.device_mesh``), :attr:`expert_bias_group`,
   :attr:`data_parallel_size` and :attr:`distributed_sampler_kwargs` (DP rank and size);
   :attr:`context_parallel` (the CP group, size and rank) and :meth:`shard_batch` (this CP rank's
   load-balanced chunks of a batch, with global position ids);
4. :meth:`shard_module`: with ``cp > 1`` ``enable_context_parallel`` on the module's attention (a
   model it cannot wrap is refused, naming the module); ``parallelize_moe_model`` (with
   ``sequence_parallel`` and ``vocab_parallel``) unless the module is sharded already; with
   ``cp > 1`` the MoE layers' switch aux-loss counts summed over the CP group (``tp_cp`` with
   sequence parallel); then
   materialisation of a meta-device module (its MoE layers' global aux-loss counters zeroed), then
   expert seeding per global expert id (always after
   meta-device init, so every EP rank holds different experts and the values do not depend on the
   layout; with ``expert_init_seed`` also after ordinary init);
5. :func:`mesh_aware_clip_norm` / :func:`mesh_aware_clip_value`: gradient clipping over DTensors on
   both meshes (``parallel/grad.py``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_moe.checks import check_bool
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import reset_global_aux_counts
from lightning_moe.parallel.fold_batch import ContextParallel, shard_batch
from lightning_moe.parallel.finite import check_nonfinite_options
from lightning_moe.parallel.grad import clip_grad_norm_, clip_grad_value_
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.liveness import (
    check_liveness_timeout,
    collective_timeout,
    ensure_watchdog,
    is_collective_failure,
    running_watchdog,
)
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import (
    DispatcherKind,
    check_dispatcher,
    check_model_for_layout,
    init_experts_by_id,
    parallelize_moe_model,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Degree",
    "FoldedMoECore",
    "check_args",
    "check_model_for_context_parallel",
    "check_namespace",
    "check_parallel_options",
    "folded_layout",
    "mesh_aware_clip_norm",
    "mesh_aware_clip_value",
]

Degree = Literal["auto"] | int


def check_namespace(obj: Any, owner: str) -> None:
    """Raise if ``obj`` comes from the ``pytorch_lightning`` package (separate registries/classes)."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "pytorch_lightning":
            raise TypeError(
                f"{owner}: got {cls.__module__}.{cls.__name__} from the `pytorch_lightning` namespace; lightning-moe "
                "supports the `lightning` namespace only: use `import lightning.pytorch as pl` (and `lightning.Fabric`)."
            )


def check_args(
    owner: str, tp: int, cp: int, ep: int, etp: int, pp: int, dp: Degree, edp: Degree, order: str, dispatcher: str
) -> None:
    """Checks that need no world size (constructor time)."""
    check_dispatcher(dispatcher, owner)
    if pp != 1 and isinstance(pp, int) and pp > 1:
        raise ValueError(f"{owner}: pp={pp} is not supported; pipeline parallel comes later; set pp=1.")
    for name, value in (("dp", dp), ("edp", edp)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name}={value!r} must be 'auto' or a positive int.")
    # Order tokens and positive degrees are checked by FoldedLayout with a world that always divides.
    world = tp * cp * ep * etp * pp if all(isinstance(d, int) and d > 0 for d in (tp, cp, ep, etp, pp)) else 1
    FoldedLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)


def check_parallel_options(owner: str, tp: int, sequence_parallel: Any, vocab_parallel: Any) -> None:
    """``sequence_parallel`` and ``vocab_parallel`` are bools and act on a TP group: both need ``tp > 1``."""
    for name, value in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel)):
        check_bool(owner, name, value)
        if value and tp == 1:
            raise ValueError(
                f"{owner}: {name}=True needs tensor parallel (it splits over the TP group) but tp=1; "
                f"set tp>1 or {name}=False."
            )


def check_model_for_context_parallel(owner: str, module: nn.Module, cp: int) -> None:
    """With ``cp > 1``: attention that context parallel cannot wrap raises ``TypeError`` naming the
    module (``enable_context_parallel``'s check, nothing enabled yet); no MoE layer may use
    ``aux_loss="seq"`` (its per-sequence counts would see only this rank's chunks): ``ValueError``
    naming the layer. No collective."""
    if cp == 1:
        return
    from lightning_moe.parallel.context import enable_context_parallel

    try:
        enable_context_parallel(module, None)  # checks every attention module; the group stays unset
    except ValueError:
        pass  # no attention at all yet: a module that configure_model builds is checked when it is sharded
    for name, m in module.named_modules():
        if isinstance(m, MoELayer) and m.config.aux_loss == "seq":
            raise ValueError(
                f"{owner}: cp={cp} with aux_loss='seq' at {name!r} is not supported: each context-parallel "
                "rank holds only chunks of every sequence; use aux_loss='switch' or 'global', or cp=1."
            )


def folded_layout(
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


def mesh_aware_clip_norm(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip ``module``'s gradients to a total norm over both meshes; returns the norm before clipping."""
    return clip_grad_norm_(module.parameters(), float(max_norm), float(norm_type), error_if_nonfinite)


def mesh_aware_clip_value(module: nn.Module, clip_val: float) -> None:
    """Clamp ``module``'s gradients to ``[-clip_val, clip_val]`` (DTensors on either mesh)."""
    clip_grad_value_(module.parameters(), float(clip_val))


def _is_sharded(module: nn.Module) -> bool:
    """True if ``module`` was sharded already (FSDP2 modules or DTensor parameters inside)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


class FoldedMoECore:
    """Degrees, layout, meshes, sampler arguments, sharding, meta-device init and expert seeding.

    Listed before Lightning's ``ModelParallelStrategy`` (Trainer or Fabric) in a strategy's bases;
    the strategy supplies the rest of Lightning's interface.

    Args:
        tp: tensor-parallel degree of attention and dense MLPs.
        cp: context-parallel degree of attention: each sequence is cut into ``2*cp`` chunks and
            CP rank r holds chunks r and ``2*cp-1-r`` (load-balanced causal work); attention
            all-gathers keys/values over the CP group. The sequence length must be a multiple
            of ``2*cp``.
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
            (layout-independent, every EP rank distinct); always done (seed 0 when unset) for a
            module built on the meta device.
        save_distributed_checkpoint: DCP folder (sharded, reshardable) instead of one file.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks the device's default.
        timeout: collective timeout of the default process group (``init_process_group``), in
            seconds or a ``datetime.timedelta``; ``None`` is torch's default. A collective that
            waits longer raises.
        rank_liveness_timeout_s: every rank heartbeats into the c10d store from a thread; a rank
            whose process is gone (same host: within 0.5 s) or that sent no heartbeat for this many
            seconds is named in a one-line error on every other rank, which then exits with code 1
            (``parallel/liveness.py``). ``None`` turns the watchdog off.
        guard_nonfinite: before every optimizer step, check the loss and the gradients (local
            shards, one 16-byte all-reduce over the world) and raise ``FloatingPointError`` naming
            the first parameter and module holding NaN/inf, before clipping and before any weight
            changes (``parallel/finite.py``; measured: 4 % of a tiny-model CPU step).
        skip_nonfinite: with the guard on, skip up to this many non-finite steps in a row (their
            gradients are dropped, the optimizer changes nothing; the step still counts toward
            ``global_step`` and the LR schedule) and raise at the next; 0 raises at the first.
        sequence_parallel: in the TP regions shard the residual stream and the norms along the
            sequence over the TP group (``parallelize_moe_model(sequence_parallel=True)``); needs ``tp > 1``.
        vocab_parallel: split the embedding rows and the output head's vocabulary over the TP
            group (the loss is ``lm_cross_entropy``'s vocab-parallel cross-entropy); needs ``tp > 1``.
    """

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
        timeout: float | timedelta | None = 1800.0,
        rank_liveness_timeout_s: float | None = 30.0,
        guard_nonfinite: bool = True,
        skip_nonfinite: int = 0,
        sequence_parallel: bool = False,
        vocab_parallel: bool = False,
    ) -> None:
        check_args(type(self).__name__, tp, cp, ep, etp, pp, dp, edp, order, dispatcher)
        check_parallel_options(type(self).__name__, tp, sequence_parallel, vocab_parallel)
        self.rank_liveness_timeout_s = check_liveness_timeout(type(self).__name__, rank_liveness_timeout_s)
        check_nonfinite_options(type(self).__name__, guard_nonfinite, skip_nonfinite)
        super().__init__(  # type: ignore[call-arg] # the Lightning strategy after this class in the MRO
            *self._lightning_init_args(),
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=collective_timeout(type(self).__name__, timeout),
        )
        self.tp, self.cp, self.ep, self.etp, self.pp = tp, cp, ep, etp, pp
        self.dp, self.edp, self.order, self.dispatcher = dp, edp, order, dispatcher
        self.expert_init_seed = expert_init_seed
        self.guard_nonfinite, self.skip_nonfinite = guard_nonfinite, skip_nonfinite
        self.sequence_parallel, self.vocab_parallel = sequence_parallel, vocab_parallel
        self._folded_mesh: FoldedMesh | None = None

    def _lightning_init_args(self) -> tuple[Any, ...]:
        """Positional arguments of the Lightning strategy's constructor before its keywords."""
        return ()

    # ---- meshes ---------------------------------------------------------------------------------

    @property
    def folded_mesh(self) -> FoldedMesh:
        """Dense and expert meshes; raises ``RuntimeError`` before ``setup_environment``."""
        if self._folded_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}: the folded mesh is built in setup_environment; read it from a hook that "
                "runs after the processes start (configure_model, setup, on_fit_start; with Fabric after "
                "fabric.launch())."
            )
        return self._folded_mesh

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The dense DeviceMesh (axes ``pp dp cp tp`` in rank order), as ``ModelParallelStrategy``'s.

        The expert view is ``folded_mesh.expert``. Raises ``RuntimeError`` before ``setup_environment``.
        """
        return self.folded_mesh.dense

    @property
    def expert_bias_group(self) -> Any:
        """Group the router's token counts are summed over: the ranks that route different tokens.

        DP x CP (``dp_cp``); with ``sequence_parallel`` every TP rank routes its own sequence shard
        too, so the whole world (``pp=1``). ``None`` when every rank routes the same tokens.
        """
        lay = self.folded_mesh.layout
        if self.sequence_parallel and lay.tp > 1:
            return torch.distributed.group.WORLD
        return self.folded_mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None

    @property
    def context_parallel(self) -> ContextParallel:
        """The CP group (``None`` at ``cp=1``), its size and this rank's coordinate in it."""
        lay = self.folded_mesh.layout
        if lay.cp == 1:
            return ContextParallel(None, 1, 0)
        return ContextParallel(self.folded_mesh.group("cp"), lay.cp, self.folded_mesh.rank("cp"))

    @property
    def loss_group(self) -> tuple[Any, int]:
        """The ranks whose labelled tokens make up one micro-batch of the step, and their number:
        ``dp_cp`` (``(None, 1)`` with one data rank). ``lm_token_mean_loss`` divides by their count."""
        lay = self.folded_mesh.layout
        if lay.dp * lay.cp == 1:
            return None, 1
        return self.folded_mesh.group("dp_cp"), lay.dp * lay.cp

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This CP rank's part of ``batch`` (``fold_batch.shard_batch``); the batch itself at ``cp=1``.

        Every ``[B, S]`` tensor (``input_ids``, ``labels``, ``position_ids``, ``document_ids``) is cut
        to chunks r and ``2*cp-1-r`` of ``2*cp``; ``position_ids`` is added (the global positions)
        when the batch has none. A length that is not a multiple of ``2*cp`` raises ``ValueError``
        before any collective.
        """
        cp = self.context_parallel
        return shard_batch(batch, cp.size, cp.rank, owner=type(self).__name__)

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas of the dense layers (``dp``): the ranks that read
        different samples. ``world_size // data_parallel_size`` ranks (``tp*cp``) share each batch."""
        return self.folded_mesh.layout.dp

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel rank and size: tensor/context-parallel ranks of one DP rank read the same batch."""
        return {"num_replicas": self.folded_mesh.layout.dp, "rank": self.folded_mesh.rank("dp")}

    @override
    def setup_environment(self) -> None:
        """Layout and model checks (no collective), then the device, WORLD and the folded mesh."""
        strategy: Any = self
        owner = type(self).__name__
        world = strategy.num_nodes * strategy.num_processes
        layout = folded_layout(owner, world, self.tp, self.cp, self.ep, self.etp, self.pp, self.dp, self.edp, self.order)
        module = self._module_to_check()
        if module is not None:
            check_model_for_layout(module, layout, **self._parallel_options())
            check_model_for_context_parallel(owner, module, layout.cp)
        if strategy.accelerator is not None:
            strategy.accelerator.setup_device(strategy.root_device)
        strategy._setup_distributed()
        self._start_watchdog(layout, strategy.global_rank)
        self._folded_mesh = FoldedMesh.build(layout, strategy.root_device.type)

    def _start_watchdog(self, layout: FoldedLayout, rank: int) -> None:
        """The rank-liveness watchdog (one per process), unless off or alone."""
        if self.rank_liveness_timeout_s is None or layout.world_size < 2:
            return

        def describe(r: int) -> str:
            return " ".join(f"{a}={c}" for a, c in layout.coords(r).items() if layout.size(a) > 1)

        ensure_watchdog(
            rank, layout.world_size, self.rank_liveness_timeout_s, owner=type(self).__name__, describe=describe
        )

    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a peer died gets the watchdog's line naming it as a note."""
        watchdog = running_watchdog()
        if watchdog is not None and is_collective_failure(exception):
            verdict = watchdog.wait_verdict(watchdog.monitor.threshold_s + 2.0)
            if verdict is not None:
                exception.add_note(verdict)
        parent: Any = super()
        if hasattr(parent, "on_exception"):
            parent.on_exception(exception)

    def _module_to_check(self) -> nn.Module | None:
        """The module known before the processes start (the Trainer's LightningModule), if any."""
        return None

    # ---- model ----------------------------------------------------------------------------------

    def shard_module(self, module: nn.Module, root: nn.Module | None = None, shard_root: bool = False) -> nn.Module:
        """Shard ``module`` for the folded mesh, materialise it, seed its experts; returns it.

        ``root`` is what Lightning holds (a wrapper around ``module`` or ``module`` itself) and is
        materialised; ``shard_root`` also FSDP-shards the root (Fabric passes a plain module). A
        module sharded already (``configure_model`` did it) is kept as it is.
        """
        owner = type(self).__name__
        check_namespace(module, owner)
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError(
                f"{owner}: {type(module).__name__} holds torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) "
                "modules; pass the unwrapped module: the strategy shards it with FSDP2 (fully_shard)."
            )
        mesh = self.folded_mesh
        had_meta = any(p.is_meta for p in module.parameters())
        check_model_for_context_parallel(owner, module, mesh.layout.cp)
        self._enable_context_parallel(module)  # also for a module configure_model sharded already
        if not _is_sharded(module):
            check_model_for_layout(module, mesh.layout, **self._parallel_options())
            parallelize_moe_model(
                module, mesh=mesh, dispatcher=self.dispatcher, shard_root=shard_root, **self._parallel_options()
            )
        self._sum_aux_counts_over_sequences(module)
        strategy: Any = self
        _materialize_distributed_module(root if root is not None else module, strategy.root_device)
        if had_meta:  # the layers' global aux-loss counters are buffers without reset_parameters
            reset_global_aux_counts(module)
        if had_meta or self.expert_init_seed is not None:
            init_experts_by_id(module, mesh, self.expert_init_seed if self.expert_init_seed is not None else 0)
        return module

    def _parallel_options(self) -> dict[str, bool]:
        """``sequence_parallel``/``vocab_parallel`` for ``parallelize_moe_model``, only those turned on."""
        return {k: True for k in ("sequence_parallel", "vocab_parallel") if getattr(self, k)}

    def _enable_context_parallel(self, module: nn.Module) -> None:
        """With ``cp > 1``: every attention of ``module`` attends over the CP group.

        ``enable_context_parallel`` raises for attention it cannot wrap, naming the module, before
        anything changes (and before ``parallelize_moe_model``).
        """
        cp = self.context_parallel
        if cp.group is None:
            return
        from lightning_moe.parallel.context import enable_context_parallel

        enable_context_parallel(module, cp.group)

    def _sum_aux_counts_over_sequences(self, module: nn.Module) -> None:
        """With ``cp > 1``: MoE switch aux-loss counts summed over the ranks holding the sequences.

        Each MoE layer routes only this rank's tokens; its switch aux loss takes the per-expert
        counts of the whole sequences with the local probabilities, so the CP average of the local
        losses (FSDP's gradient average over ``dp_cp``) is the loss of the whole sequences. With
        sequence parallel the TP ranks hold shards of the same sequences too: counts over ``tp_cp``.
        """
        cp = self.context_parallel
        if cp.group is None:
            return
        lay = self.folded_mesh.layout
        group = self.folded_mesh.group("tp_cp") if self.sequence_parallel and lay.tp > 1 else cp.group
        for m in module.modules():
            if isinstance(m, MoELayer):
                m.aux_loss_sequence_group = group
