"""The strategy core that ``FoldedMoEStrategy`` (Trainer) and ``FabricFoldedMoEStrategy`` share.

Both strategies are :class:`FoldedMoECore` placed before Lightning's ``ModelParallelStrategy``
of their side (``class FoldedMoEStrategy(FoldedMoECore, ModelParallelStrategy)``). The core reads
as a table of contents; each concern is a module of plain functions a user can call without a
strategy:

- ``layout.py``: constructor checks, :func:`folded_layout` for a world size, views of the mesh
  (CP group, loss group, expert-bias group, sampler arguments);
- ``module_setup.py``: :func:`prepare_module`, the ordered steps over ``sharding.py``
  (context parallel, ``parallelize_moe_model``, aux-loss counts) and ``materialize.py``
  (meta-device materialisation, expert seeding per global expert id);
- ``guards.py``: the rank-liveness watchdog and the non-finite guard (Trainer and Fabric);
- ``clipping.py``: gradient clipping over both meshes;
- ``checkpoint_io.py`` and ``optimizers.py``: used by the two strategies' own classes.

Stages of the core:

1. ``__init__``: typed degrees and options and the checks that need no world size, then the
   Lightning strategy's own constructor;
2. ``setup_environment``: :func:`folded_layout` for the world size and the model checks *before*
   any collective; then the accelerator's device, the default process group (WORLD: gloo on CPU,
   nccl on GPU), the liveness watchdog and :meth:`FoldedMesh.build` (new groups);
3. meshes: :attr:`folded_mesh`, :attr:`device_mesh` (the dense mesh, as Lightning's
   ``ModelParallelStrategy.device_mesh``), :attr:`expert_bias_group`, :attr:`context_parallel`,
   :attr:`loss_group`, :meth:`shard_batch`, :attr:`data_parallel_size`,
   :attr:`distributed_sampler_kwargs`;
4. :attr:`module_plan` and :meth:`shard_module` (:func:`prepare_module` on this strategy's device).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from typing_extensions import override

from lightning_moe.parallel.finite import check_nonfinite_options
from lightning_moe.parallel.fold_batch import ContextParallel, shard_batch
from lightning_moe.parallel.liveness import check_liveness_timeout, collective_timeout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import DispatcherKind, check_model_for_layout
from lightning_moe.parallel.pipeline import stage_indices
from lightning_moe.parallel.pipeline_stage import cut_stages_of
from lightning_moe.strategies.guards import note_dead_rank, start_liveness_watchdog
from lightning_moe.strategies.layout import (
    Degree,
    check_args,
    check_parallel_options,
    context_parallel_of,
    expert_bias_group_of,
    folded_layout,
    loss_group_of,
    sampler_kwargs_of,
)
from lightning_moe.strategies.materialize import has_meta_parameters
from lightning_moe.strategies.module_setup import prepare_module
from lightning_moe.strategies.pipeline_setup import (
    check_pipeline_batch,
    check_pipeline_combination,
    check_pipeline_model,
    check_pipeline_overlap,
    cut_for_pipeline,
    find_transformer,
    pipeline_options,
)
from lightning_moe.strategies.pipeline_hf import find_hf_causal_lm, hf_stages_cut_already, restore_hf_buffers
from lightning_moe.strategies.pipeline_step import PipelineRunner
from lightning_moe.strategies.sharding import ModulePlan, check_model_for_context_parallel, parallel_options

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FoldedMoECore"]


class FoldedMoECore:
    """Degrees, layout, meshes, sampler arguments and module preparation of a folded strategy.

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
        pp: pipeline-parallel degree: the transformer's blocks are cut into ``pp * pp_virtual_stages``
            stages over the ``pp`` groups (``strategies/pipeline_setup.py``); each batch runs as
            ``pp_microbatches`` micro-batches through ``pp_schedule`` (``strategies/pipeline_step.py``).
            Needs an ``MoETransformer``-shaped model (or a Hugging Face causal LM of a family that
            can be cut, at ``cp=1`` without sequence parallel) without tied embeddings, and no
            vocab parallel; context parallel, sequence parallel and packed documents carry
            through the stages.
        pp_schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``, ``"zbv"`` or
            ``"dualpipev"`` (``parallel/pipeline.py``); checked against this torch at construction.
        pp_microbatches: micro-batches per batch (the batch size must be a multiple); ``None`` is
            the schedule's minimum, ``pp * pp_virtual_stages``.
        pp_virtual_stages: stages per rank; ``None`` is the schedule's count (1; 2 for the
            interleaved and "V" schedules).
        pp_overlap_expert_comm: in the schedule's steady state, run one micro-batch's forward and
            another's backward taking turns at their expert all-to-alls, so one's all-to-all is in
            flight while the other computes (``parallel/pipeline_overlap.py``); the numbers are
            those without it, also with activation recompute, FP8, sequence parallel and
            ``etp > 1`` (``docs/layouts.md``). Needs ``pp_schedule="dualpipev"`` (the schedule whose torch class has
            overlapped forward+backward actions), ``ep > 1`` and ``dispatcher`` ``"alltoall"`` or
            ``"alltoall_dedup"``; refused otherwise at construction.
        dp: data-parallel degree of the dense layers, ``"auto"`` = ``W/(tp*cp*pp)``.
        edp: data-parallel degree of the experts, ``"auto"`` = ``W/(etp*ep*pp)``.
        order: rank order, fastest first (Megatron-Core's ``RankGenerator``), e.g. ``"tp-cp-ep-dp-pp"``.
        dispatcher: token exchange over the EP group: ``"alltoall_dedup"`` (default: NCCL
            all-to-all sending each token once per destination rank), ``"alltoall"`` (one row per
            routed slot), ``"allgather"``, ``"deepep"`` or ``"hybridep"`` (the last two need the
            optional ``deep_ep`` package, and bf16).
        expert_init_seed: if set, experts are re-initialised per global expert id from this seed
            (layout-independent, every EP rank distinct); always done (seed 0 when unset) for a
            module built on the meta device. Done once per module: experts seeded already (a
            ``validate`` or ``predict`` after ``fit``) or loaded from a checkpoint
            (``HFMoELanguageModel(pretrained=...)``) keep their weights.
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
            changes (``parallel/finite.py``; measured: 4 % of a tiny-model CPU step). The strategy
            owns this option and ``skip_nonfinite``: the Trainer's strategy runs the guard in its
            ``optimizer_step``, Fabric's in the step the optimizer from ``fabric.setup`` calls
            (the losses of ``fabric.backward`` since the last step) - ``strategies/guards.py``.
        skip_nonfinite: with the guard on, skip up to this many non-finite steps in a row (their
            gradients are dropped, the optimizer changes nothing; the step still counts toward
            ``global_step`` and the LR schedule) and raise at the next; 0 raises at the first.
        sequence_parallel: in the TP regions shard the residual stream and the norms along the
            sequence over the TP group (``parallelize_moe_model(sequence_parallel=True)``); needs ``tp > 1``.
        vocab_parallel: split the embedding rows and the output head's vocabulary over the TP
            group (the loss is ``lm_cross_entropy``'s vocab-parallel cross-entropy); needs ``tp > 1``.
    """

    owns_nonfinite_guard = True  # MoELanguageModelBase leaves its non-finite guard to the strategy

    def __init__(
        self,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int = 1,
        pp: int = 1,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_virtual_stages: int | None = None,
        pp_overlap_expert_comm: bool = False,
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
        self.pipeline_options = pipeline_options(
            type(self).__name__, pp, pp_schedule, pp_microbatches, pp_virtual_stages, pp_overlap_expert_comm
        )
        check_pipeline_overlap(type(self).__name__, self.pipeline_options, ep, dispatcher)
        check_pipeline_combination(type(self).__name__, self.pipeline_options, cp, sequence_parallel, vocab_parallel)
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
        self._pipeline: PipelineRunner | None = None

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
        """Group the router's token counts are summed over (``layout.expert_bias_group_of``)."""
        return expert_bias_group_of(self.folded_mesh, self.sequence_parallel)

    @property
    def context_parallel(self) -> ContextParallel:
        """The CP group (``None`` at ``cp=1``), its size and this rank's coordinate in it."""
        return context_parallel_of(self.folded_mesh)

    @property
    def loss_group(self) -> tuple[Any, int]:
        """The ranks whose labelled tokens make up one micro-batch of the step, and their number:
        ``dp_cp`` (``(None, 1)`` with one data rank). ``lm_token_mean_loss`` divides by their count."""
        return loss_group_of(self.folded_mesh)

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
        return sampler_kwargs_of(self.folded_mesh)

    # ---- processes ------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        """Layout and model checks (no collective), then the device, WORLD, the watchdog and the folded mesh."""
        strategy: Any = self
        owner = type(self).__name__
        world = strategy.num_nodes * strategy.num_processes
        module = self._module_to_check()
        if module is not None:  # the pipeline checks need no world size
            self.check_pipeline_model(module)
            self.check_pipeline_batch(self._batch_size_to_check())  # type: ignore[arg-type] # None: not known
        layout = folded_layout(owner, world, self.tp, self.cp, self.ep, self.etp, self.pp, self.dp, self.edp, self.order)
        if module is not None:
            check_model_for_layout(module, layout, **parallel_options(self.sequence_parallel, self.vocab_parallel))
            check_model_for_context_parallel(owner, module, layout.cp)
        if strategy.accelerator is not None:
            strategy.accelerator.setup_device(strategy.root_device)
        strategy._setup_distributed()
        start_liveness_watchdog(owner, layout, strategy.global_rank, self.rank_liveness_timeout_s)
        self._folded_mesh = FoldedMesh.build(layout, strategy.root_device.type)

    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a peer died gets the watchdog's line naming it as a note."""
        note_dead_rank(exception)
        parent: Any = super()
        if hasattr(parent, "on_exception"):
            parent.on_exception(exception)

    def _module_to_check(self) -> nn.Module | None:
        """The module known before the processes start (the Trainer's LightningModule), if any."""
        return None

    def _batch_size_to_check(self) -> int | None:
        """The training batch size known before the processes start (a data module's), if any."""
        return None

    # ---- model ----------------------------------------------------------------------------------

    @property
    def module_plan(self) -> ModulePlan:
        """How this strategy lays a module out (its mesh and options), for ``prepare_module`` and
        for a ``configure_model`` that shards by itself."""
        return ModulePlan(
            type(self).__name__, self.folded_mesh, self.dispatcher, self.sequence_parallel, self.vocab_parallel,
            self.expert_init_seed,
        )  # fmt: skip

    def check_pipeline_model(self, module: nn.Module) -> None:
        """``module`` can be cut into this strategy's stages (``pipeline_setup.check_pipeline_model``);
        the Trainer's strategy runs it in ``setup_environment``, before any process group."""
        check_pipeline_model(
            type(self).__name__, self.pipeline_options, module, cp=self.cp, sequence_parallel=self.sequence_parallel
        )

    def check_pipeline_batch(self, batch_size: int) -> None:
        """A batch of ``batch_size`` rows divides into ``pp_microbatches`` (nothing at ``pp=1``)."""
        check_pipeline_batch(type(self).__name__, self.pipeline_options, batch_size)

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's stages and schedule at ``pp > 1`` once the module is set up, else ``None``.

        ``pipeline.train_step(batch, accumulate)`` runs forward and backward of every micro-batch
        and returns the loss to log; ``pipeline.eval_step(batch)`` runs forward only."""
        return self._pipeline

    def shard_module(self, module: nn.Module, root: nn.Module | None = None, shard_root: bool = False) -> nn.Module:
        """Shard ``module`` for the folded mesh, materialise it, seed its experts; returns it
        (:func:`~lightning_moe.strategies.module_setup.prepare_module`). A module sharded already
        (``configure_model`` did it) keeps its layout. At ``pp > 1`` the transformer is first cut
        into this rank's stages (the returned module is then the stages when ``module`` was the
        transformer), unless ``configure_model`` cut it already (``HFMoELanguageModel(load_sharded=True)``
        reads only its stages' tensors), and :attr:`pipeline` is built."""
        strategy: Any = self
        options, mesh = self.pipeline_options, self.folded_mesh
        stages = None
        if options.pp > 1 and self._pipeline is not None and cut_stages_of(module) is self._pipeline.stages:
            # set up again (validate or predict after fit): the stages and the pipeline stay
            return prepare_module(module, self.module_plan, strategy.root_device, root=root, shard_root=shard_root)
        if options.pp > 1:
            mine = stage_indices(mesh.rank("pp"), options.pp, options.schedule, options.virtual_stages)
            cut = hf_stages_cut_already(type(self).__name__, module, mine)
            if cut is not None:  # configure_model cut, laid out and loaded them (HFMoELanguageModel load_sharded)
                stages, hidden = cut
            else:
                _, model = find_transformer(module)
                model = model if model is not None else find_hf_causal_lm(module)[1]
                hidden = int(model.config.hidden_size) if model is not None else 0
                module, stages = cut_for_pipeline(
                    type(self).__name__, options, module, mesh.rank("pp"), cp=self.cp,
                    sequence_parallel=self.sequence_parallel,
                )  # fmt: skip
            had_meta = has_meta_parameters(stages)
        module = prepare_module(module, self.module_plan, strategy.root_device, root=root, shard_root=shard_root)
        if stages is not None:
            if had_meta:  # HF stages: the rotary frequencies, buffers without reset_parameters
                restore_hf_buffers(stages)
            self._pipeline = PipelineRunner(
                type(self).__name__, options, stages, mesh.group("pp"), mesh.rank("pp"), self.loss_group,
                strategy.root_device, hidden, sequence_shards=mesh.size("tp") if self.sequence_parallel else 1,
                context=self.context_parallel,
            )  # fmt: skip
        return module
