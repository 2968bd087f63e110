"""One batch through the pipeline: forward and backward (training) or forward only (validation).

Legend: B rows of a batch, S sequence, H hidden, n micro-batches, b = B/n rows of one.

A :class:`PipelineRunner` belongs to a strategy at ``pp > 1``; the training step calls
:meth:`PipelineRunner.train_step` with the step's batch instead of a forward, and the schedule of
``parallel/pipeline_schedule.py`` runs every micro-batch's forward *and backward* (torch's
``schedule.step``). The strategies therefore skip their own backward for that loss (the Trainer's
``FoldedMoEStrategy.backward`` calls the backward hooks only; Fabric's loop calls no
``fabric.backward``). Stages of one call:

1. checks: ``input_ids``/``labels`` of ``B`` rows, ``B`` a multiple of ``n`` (``ValueError`` on
   every rank alike: they all hold the same batch); under context parallel the batch is cut to
   this CP rank's load-balanced chunks with their global ``position_ids`` (as at ``pp = 1``); the batch's ``position_ids`` and
   ``document_ids`` (packed documents) go to the schedule as keyword arguments, which torch's
   schedules split into micro-batches and hand to every stage (positional arguments reach only the
   first), so each stage builds its RoPE and document mask as the whole model would (a Hugging
   Face model's stages too: ``models/hf_pipeline_stage.py``);
2. the loss normalisation: the labelled tokens of the whole batch, summed over the loss group
   (``dp_cp``, one all-reduce); each micro-batch's loss is its token sum times
   ``ranks / tokens / accumulate``, so the sum of the micro-batch gradients, averaged by FSDP over
   ``dp_cp`` and accumulated over ``accumulate`` batches, is the gradient of the mean over every
   labelled token, as one process computes it. The MoE layers' aux losses are scaled by
   ``1 / (accumulate * n)`` (each micro-batch routes on its own, as one process running the same
   micro-batches);
3. training: torch's schedule for this batch shape (built once per shape, with the stage shapes
   given up front — the hidden states ``[b, S/tp, H]`` under sequence parallel — so torch runs no
   shape-inference forward through the MoE layers; the
   zero-bubble schedules compute weight gradients with the input gradients, see ``_SPLIT``; FSDP
   reduces each stage's gradients once, in its last micro-batch's backward, and not at all on an
   accumulating batch: ``parallel/pipeline_sync.py``; with ``pp_overlap_expert_comm`` the
   schedule's overlapped forward+backward actions take turns at the MoE layers' all-to-alls,
   ``parallel/pipeline_overlap.py``);
   validation: each micro-batch forward through the stages in order (:meth:`_forward_only`);
4. the loss to log: the sum of the micro-batch losses times ``accumulate`` (the batch's
   token-mean share of this data rank), broadcast over the pp group from the rank holding the
   last stage, so every rank returns the number one process would;
5. the MoE statistics to log (:meth:`PipelineRunner.moe_stats`): each training step's routed
   tokens per expert and aux losses of every MoE layer, tallied over the micro-batches on each
   rank and summed over the pp group (``parallel/pipeline_moe_stats.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.moe.utils import set_aux_loss_scale
from lightning_moe.parallel.fold_batch import IGNORE_INDEX, ContextParallel, shard_batch
from lightning_moe.parallel.pipeline import stage_indices
from lightning_moe.parallel.pipeline_moe_stats import PipelineMoEStats, StepMoEStats
from lightning_moe.parallel.pipeline_overlap import attach_comm_turns
from lightning_moe.parallel.pipeline_schedule import build_schedule
from lightning_moe.parallel.pipeline_stage import LocalStages
from lightning_moe.parallel.sequence import check_sequence_length
from lightning_moe.parallel.vocab import lm_cross_entropy
from lightning_moe.strategies.pipeline_setup import PipelineOptions, check_pipeline_batch

__all__ = ["PipelineRunner"]

_PACKED_KEYS = ("position_ids", "document_ids")
# Zero-bubble schedules split each backward into input (I) and weight (W) gradients; torch computes
# W outside autograd's ordinary backward, where FSDP2's hooks never see those gradients. With a
# ``dw_builder`` the I step runs the full backward and W is empty: the schedule's order and
# messages stay, its weight-gradient deferral does not.
_SPLIT = ("zbv", "dualpipev")


def _no_weight_pass() -> None:
    return None


def _full_backward() -> Any:
    return _no_weight_pass


class PipelineRunner:
    """This rank's stages under the strategy's schedule (module docstring).

    Args:
        owner: the strategy's name, for messages.
        options: the checked pipeline options.
        stages: this rank's :class:`LocalStages` (after parallelize and materialisation).
        pp_group, pp_rank: the pipeline group and this rank's coordinate in it.
        loss_group: ``(group, ranks)`` whose labelled tokens make up one batch (``dp_cp``).
        device: where the stages run.
        hidden_size: ``H`` of the activations sent between stages.
        sequence_shards: ``tp`` under sequence parallel (the hidden states between stages hold
            ``S/tp`` positions, and every stage gets ``position_ids``, ``0..S-1`` when the batch
            has neither them nor ``document_ids``, to build its RoPE for the whole sequence), else 1.
        context: the CP group, size and this rank's coordinate (``cp > 1``: each batch is cut to
            this rank's load-balanced chunks with their global ``position_ids`` first,
            ``fold_batch.shard_batch``, and the stages' attention runs over the CP group).
    """

    def __init__(
        self,
        owner: str,
        options: PipelineOptions,
        stages: LocalStages,
        pp_group: Any,
        pp_rank: int,
        loss_group: tuple[Any, int],
        device: torch.device,
        hidden_size: int,
        sequence_shards: int = 1,
        context: ContextParallel = ContextParallel(None, 1, 0),
    ) -> None:
        self.owner, self.options, self.stages = owner, options, stages
        self.sequence_shards, self.context = sequence_shards, context
        self.pp_group, self.pp_rank, self.device, self.hidden_size = pp_group, pp_rank, device, hidden_size
        self.loss_group = loss_group
        last = options.stages - 1
        self.last_stage_rank = next(
            r for r in range(options.pp) if last in stage_indices(r, options.pp, options.schedule, options.virtual_stages)
        )
        self._schedules: dict[tuple[int, ...], Any] = {}
        self._scale = 1.0
        self._moe_stats = PipelineMoEStats(stages.stages, stages, pp_group, device)
        self._turns = CommTurns() if options.overlap_expert_comm else None
        if self._turns is not None:  # the MoE layers' all-to-alls take turns in overlapped actions
            attach_comm_turns(stages, self._turns)

    @property
    def holds_first(self) -> bool:
        return any(view.is_first for _, view in self.stages.stages)

    @property
    def holds_last(self) -> bool:
        return any(view.is_last for _, view in self.stages.stages)

    def train_step(self, batch: dict[str, torch.Tensor], accumulate: int = 1) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch``; returns the detached loss to log."""
        set_aux_loss_scale(self.stages, 1.0 / (max(accumulate, 1) * self.options.microbatches))
        return self._run(batch, train=True, accumulate=max(accumulate, 1))

    def eval_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only (validation); returns the loss of ``batch`` as :meth:`train_step` would."""
        with torch.no_grad():
            return self._run(batch, train=False, accumulate=1)

    def _run(self, batch: dict[str, torch.Tensor], train: bool, accumulate: int) -> torch.Tensor:
        if train:
            self._check_no_hf_checkpointing_under_cp()
        ids_BS, labels_BS, ids_kw = self._check_batch(batch, whole_microbatches=train)
        group, ranks = self.loss_group
        tokens = (labels_BS != IGNORE_INDEX).sum().to(torch.float32).reshape(())
        if group is not None and ranks > 1:
            dist.all_reduce(tokens, group=group)
        else:
            ranks = 1
        self._scale = ranks / float(tokens.clamp(min=1.0)) / accumulate  # SYNC: one number per batch
        ids_BS, labels_BS = ids_BS.to(self.device), labels_BS.to(self.device)
        ids_kw = {k: v.to(self.device) for k, v in ids_kw.items()}
        if not train:
            return self._loss_to_log(self._forward_only(ids_BS, labels_BS, ids_kw), accumulate)
        schedule, stages = self._schedule(tuple(ids_BS.shape))
        losses: list[torch.Tensor] = []
        args = (ids_BS,) if self.holds_first else ()
        target, out = (labels_BS, losses) if self.holds_last else (None, None)
        self._moe_stats.start()
        for stage in stages:
            stage.begin_step()
        try:
            schedule.step(*args, target=target, losses=out, **ids_kw)  # the kwargs reach every stage
        finally:
            self._moe_stats.stop()
            for stage in stages:
                stage.end_step()
        return self._loss_to_log(losses, accumulate)

    def moe_stats(self) -> StepMoEStats:
        """The last training step's MoE statistics of the whole model, every stage and micro-batch
        (``parallel/pipeline_moe_stats.py``); a collective over the pp group, once per step."""
        return self._moe_stats.reduce()

    def predict_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the logits ``[B, S, V]`` of ``batch`` (``input_ids``, and the packed ids when
        present; ``labels`` are not needed), on every rank of the pp group, as one process returns
        them: the last stage's rank sends them to the others (one broadcast of their shape and dtype,
        one of the logits)."""
        if self.context.size > 1:
            raise ValueError(
                f"{self.owner}: predict at cp={self.context.size} would return each CP rank's sequence chunks; "
                "predict with cp=1 (a checkpoint saved at any cp loads at cp=1)."
            )
        batch = batch if "labels" in batch else {**batch, "labels": batch["input_ids"]}
        ids_BS, _, ids_kw = self._check_batch(batch, whole_microbatches=False)
        ids_BS, ids_kw = ids_BS.to(self.device), {k: v.to(self.device) for k, v in ids_kw.items()}
        parts: list[torch.Tensor] = []
        with torch.no_grad():
            self._forward_stages(ids_BS, ids_kw, lambda m, logits_bSV: parts.append(logits_bSV))
        logits_BSV = torch.cat(parts) if self.holds_last else None
        return self._from_last_stage(logits_BSV)

    def _from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """``value`` of the rank holding the last stage, on every rank of the pp group."""
        header: list[Any] = [None if value is None else (tuple(value.shape), value.dtype)]
        dist.broadcast_object_list(header, group=self.pp_group, group_src=self.last_stage_rank)
        shape, dtype = header[0]
        if value is None:
            value = torch.empty(shape, dtype=dtype, device=self.device)
        value = value.contiguous()
        dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value

    def _forward_only(
        self, ids_BS: torch.Tensor, labels_BS: torch.Tensor, ids_kw: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Validation: the loss of each micro-batch on the last stage's rank (:meth:`_forward_stages`)."""
        labels = labels_BS.chunk(self.options.microbatches)
        losses: list[torch.Tensor] = []
        self._forward_stages(ids_BS, ids_kw, lambda m, logits_bSV: losses.append(self._loss(logits_bSV, labels[m])))
        return losses

    def _forward_stages(
        self, ids_BS: torch.Tensor, ids_kw: dict[str, torch.Tensor], on_logits: Callable[[int, torch.Tensor], None]
    ) -> None:
        """Each micro-batch through the stages in order, the hidden states sent to the rank of the
        next stage (plain send/recv over the pp group; any placement, "V" included, whose torch
        schedules have no forward-only mode). ``on_logits(m, logits)`` on the last stage's rank."""
        opts = self.options
        owner = {s: r for r in range(opts.pp) for s in stage_indices(r, opts.pp, opts.schedule, opts.virtual_stages)}
        local = dict(self.stages.stages)
        chunks = {k: v.chunk(opts.microbatches) for k, v in ids_kw.items()}
        for m, ids_bS in enumerate(ids_BS.chunk(opts.microbatches)):
            x, kw = ids_bS, {k: v[m] for k, v in chunks.items()}
            for s in range(opts.stages):
                if owner[s] != self.pp_rank:
                    continue
                if s > 0 and owner[s - 1] != self.pp_rank:
                    x = self._example(False, ids_bS.shape[0], ids_bS.shape[1], False, device=self.device)
                    dist.recv(x, group=self.pp_group, group_src=owner[s - 1])
                x = local[s](x, **kw)
                if s < opts.stages - 1 and owner[s + 1] != self.pp_rank:
                    dist.send(x.contiguous(), group=self.pp_group, group_dst=owner[s + 1])
            if self.holds_last:
                on_logits(m, x)

    def _check_no_hf_checkpointing_under_cp(self) -> None:
        """A Hugging Face model's context-parallel attention reads the ids of the micro-batch that ran
        forward last (``models/hf_context_parallel.py``); under a schedule a recomputed forward in the
        backward (transformers' ``gradient_checkpointing``) would read a later micro-batch's."""
        if self.context.size == 1:
            return
        if any(getattr(m, "gradient_checkpointing", False) is True for m in self.stages.modules()):
            raise ValueError(
                f"{self.owner}: transformers' gradient checkpointing is on in a Hugging Face model at "
                f"cp={self.context.size} and pp={self.options.pp}, where a recomputed attention would read another "
                "micro-batch's positions; call model.gradient_checkpointing_disable(), or set cp=1 or pp=1."
            )

    def _check_batch(
        self, batch: dict[str, torch.Tensor], whole_microbatches: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(input_ids, labels, per-token ids)`` of this CP rank's chunks: the ids are the batch's
        ``position_ids`` (the chunks' global positions under CP) and ``document_ids`` present,
        each ``[B, S]`` like ``input_ids``. ``whole_microbatches``: ``B`` must split into the
        micro-batches (the schedule's shapes); forward only takes any ``B >= 1`` (a loader's last,
        shorter batch runs as fewer, smaller micro-batches: ``chunk``)."""
        cp = self.context
        batch = shard_batch(batch, cp.size, cp.rank, owner=self.owner)  # the batch itself at cp=1
        ids_BS, labels_BS = batch["input_ids"], batch["labels"]
        ids_kw = {k: batch[k] for k in _PACKED_KEYS if batch.get(k) is not None}
        if ids_kw and not self.takes_ids:
            raise ValueError(
                f"{self.owner}: the batch holds {next(iter(ids_kw))!r} (packed documents), which these stages, built "
                f"without rope_positions, do not carry at pp={self.options.pp}; cut the model with cut_rank_stages "
                "(or the strategy), pack without document ids, or set pp=1."
            )
        for key, value in ids_kw.items():
            if tuple(value.shape) != tuple(ids_BS.shape):
                raise ValueError(
                    f"{self.owner}: batch[{key!r}] has shape {tuple(value.shape)}, input_ids {tuple(ids_BS.shape)}; "
                    "pass one id per token."
                )
        if whole_microbatches or ids_BS.shape[0] == 0:
            check_pipeline_batch(self.owner, self.options, int(ids_BS.shape[0]))
        B, S = ids_BS.shape
        if self.sequence_shards > 1:
            check_sequence_length(S, self.sequence_shards, owner=self.owner)
            if not ids_kw:  # the stages see S/tp positions of the hidden states (documents: their own positions)
                ids_kw["position_ids"] = torch.arange(S, device=ids_BS.device).expand(B, S)
        return ids_BS, labels_BS, ids_kw

    @property
    def takes_ids(self) -> bool:
        """Whether this rank's stages take ``position_ids`` / ``document_ids`` (``TransformerStage``
        built with ``rope_positions``, as ``cut_rank_stages`` and a Hugging Face model's stages are)."""
        return all(getattr(view, "rope_positions", None) is not None for _, view in self.stages.stages)

    def _loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """A micro-batch's token sum, times ``ranks / tokens / accumulate`` of the whole batch."""
        count = (labels_BS != IGNORE_INDEX).sum()
        if bool(count > 0):  # SYNC: one count per micro-batch
            total = lm_cross_entropy(self.stages, logits_BSV, labels_BS) * count
        else:  # no labelled token: 0, kept in the graph (the mean of nothing is NaN)
            total = logits_BSV.sum() * 0.0
        return total * self._scale

    def _schedule(self, shape: tuple[int, ...]) -> tuple[Any, list[Any]]:
        """The training schedule for batches of ``shape`` and its stages (built once per shape;
        each stage reduces FSDP gradients in its last backward only, ``parallel/pipeline_sync.py``)."""
        key = shape
        if key not in self._schedules:
            from lightning_moe.parallel.pipeline_sync import sync_once_stage

            b, S = shape[0] // self.options.microbatches, shape[1]
            stages = []
            for index, view in self.stages.stages:
                stages.append(
                    sync_once_stage(
                        view, index, self.options.stages, self.device, self.options.microbatches,
                        input_args=self._example(view.is_first, b, S, True),
                        output_args=self._example(False, b, S, True, logits=view.is_last),
                        group=self.pp_group, dw_builder=_full_backward if self.options.schedule in _SPLIT else None,
                    )
                )  # fmt: skip
            schedule = build_schedule(
                self.options.schedule, stages, self.options.microbatches, self._loss, scale_grads=False,
                turns=self._turns,
            )
            self._schedules[key] = (schedule, stages)
        return self._schedules[key]

    def _example(
        self, ids: bool, b: int, S: int, grad: bool, logits: bool = False, device: Any = "meta"
    ) -> torch.Tensor:
        """A stage's input or output (a meta tensor by default): ids ``[b, S]``, hidden ``[b, S, H]``
        (``[b, S/tp, H]`` under sequence parallel), logits ``[b, S, V]``."""
        if ids:
            return torch.empty(b, S, dtype=torch.long, device=device)
        dtype = next(p.dtype for p in self.stages.parameters() if p.is_floating_point())
        if logits and self.stages.lm_head is not None:
            width = self.stages.lm_head.out_features
        else:  # the hidden states: S/tp positions under sequence parallel
            width, S = self.hidden_size, S // self.sequence_shards
        return torch.empty(b, S, width, dtype=dtype, device=device, requires_grad=grad)

    def _loss_to_log(self, losses: list[torch.Tensor], accumulate: int) -> torch.Tensor:
        if self.holds_last:
            value = torch.stack([loss.detach().float() for loss in losses]).sum() * accumulate
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        value = value.to(self.device)
        if self.options.pp > 1:
            dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value
