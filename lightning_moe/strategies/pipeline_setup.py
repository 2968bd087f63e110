"""Pipeline parallel in a folded strategy: the options, the checks, and the cut of a module into stages.

Legend: ``pp`` ranks in a pipeline group, ``v`` virtual stages per rank, ``n`` micro-batches per batch.

Stages, in the order a strategy runs them:

1. :func:`pipeline_options` (constructor, no world size): ``pp_schedule`` known and offered by this
   torch with ``pp_virtual_stages`` per rank, ``pp_microbatches`` enough for it
   (``parallel/pipeline.py``); ``pp_overlap_expert_comm`` only for a schedule that overlaps one
   micro-batch's forward with another's backward in this torch, at ``pp > 1`` and ``ep > 1`` with
   an all-to-all dispatcher (:func:`check_pipeline_overlap`, ``parallel/pipeline_overlap.py``);
   :func:`check_pipeline_combination`: at ``pp > 1`` vocab parallel is
   refused (context and sequence parallel are not: each stage gets this CP rank's chunks with
   their global positions, and the hidden states travel sharded along the sequence over TP);
2. :func:`check_pipeline_model` and :func:`check_pipeline_batch` (``setup_environment``, before any
   process group): the module holds an ``MoETransformer``-shaped model, or a Hugging Face causal
   LM of a family that can be cut (``strategies/pipeline_hf.py``; under context or sequence parallel
   also one that ``pp = 1`` takes with them), whose blocks split evenly into ``pp * v`` stages,
   without tied embeddings; the data module's batch divides into ``n``;
3. :func:`check_pipeline_callbacks` (Trainer ``setup``): callbacks that act on the whole model in
   one forward (``supports_pipeline_parallel = False``) are refused;
4. :func:`cut_for_pipeline` (module setup, before ``parallelize``): the transformer is replaced by
   this rank's :class:`~lightning_moe.parallel.pipeline_stage.LocalStages` (the module's ``model``
   attribute, or the module itself for Fabric); TP, EP and FSDP then apply to it as to a model,
   on the meshes of this rank's pp coordinate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.models.transformer import document_positions, rope_at_positions, rope_tables
from lightning_moe.parallel.pipeline import (
    SCHEDULES,
    check_batch_split,
    check_microbatches,
    check_schedule,
    split_layers,
    stage_indices,
)
from lightning_moe.parallel.parallelize import check_sequence_parallel_attention
from lightning_moe.parallel.pipeline_overlap import check_overlap_schedule
from lightning_moe.parallel.pipeline_stage import LocalStages, cut_rank_stages, cut_stages_of
from lightning_moe.strategies.pipeline_hf import cut_hf_for_pipeline, find_hf_causal_lm, hf_layer_count
from lightning_moe.strategies.sharding import check_model_for_context_parallel

__all__ = [
    "PipelineOptions",
    "check_hf_sharded_sequences",
    "check_pipeline_batch",
    "check_pipeline_callbacks",
    "check_pipeline_combination",
    "check_pipeline_model",
    "check_pipeline_overlap",
    "check_pipeline_trainer",
    "cut_for_pipeline",
    "find_transformer",
    "pipeline_options",
]


@dataclass(frozen=True)
class PipelineOptions:
    """A checked pipeline plan: degree, schedule name, micro-batches per batch, stages per rank, and
    whether one micro-batch's expert all-to-all overlaps another's compute."""

    pp: int
    schedule: str
    microbatches: int
    virtual_stages: int
    overlap_expert_comm: bool = False

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        return (
            f"pp={self.pp}, pp_schedule={self.schedule!r}, pp_microbatches={self.microbatches}, "
            f"pp_virtual_stages={self.virtual_stages}"
        )


def pipeline_options(
    owner: str, pp: int, schedule: str, microbatches: int | None, virtual_stages: int | None,
    overlap_expert_comm: bool = False,
) -> PipelineOptions:
    """The checked options; ``None`` micro-batches is ``pp * v`` and ``None`` virtual stages is the
    schedule's own count (2 for ``interleaved_1f1b``). Raises ``ValueError`` naming the fix.
    ``overlap_expert_comm`` is kept as given (:func:`check_pipeline_overlap` checks it)."""
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"{owner}: pp_schedule={schedule!r} is unknown; choose one of {sorted(SCHEDULES)}.")
    for name, value in (("pp_microbatches", microbatches), ("pp_virtual_stages", virtual_stages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name}={value!r} must be a positive int or None (the schedule's minimum).")
    v = virtual_stages if virtual_stages is not None else (SCHEDULES[schedule].virtual_stages or 2)
    if not isinstance(pp, int) or pp < 1:
        return PipelineOptions(1, schedule, microbatches or 1, v, overlap_expert_comm)  # the degree's own check names it
    n = microbatches if microbatches is not None else pp * v
    if pp > 1:
        try:
            check_schedule(schedule, v)
            check_microbatches(schedule, n, pp, v)
        except ValueError as error:
            raise _reworded(owner, f"pp_schedule={schedule!r}, pp_microbatches={n}", error) from None
    return PipelineOptions(pp, schedule, n, v, overlap_expert_comm)


_OVERLAP_DISPATCHERS = ("alltoall", "alltoall_dedup")


def check_pipeline_overlap(owner: str, options: PipelineOptions, ep: int, dispatcher: str) -> None:
    """``pp_overlap_expert_comm=True`` needs ``pp > 1``, a schedule that overlaps a forward with a
    backward in this torch, ``ep > 1`` (an all-to-all to overlap) and an all-to-all dispatcher."""
    value = options.overlap_expert_comm
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: pp_overlap_expert_comm={value!r} must be a bool; pass True or False.")
    if not value:
        return
    if options.pp == 1:
        raise ValueError(
            f"{owner}: pp_overlap_expert_comm=True with pp=1: without pipeline stages there is no other micro-batch "
            "to overlap; set pp > 1 with pp_schedule='dualpipev', or pp_overlap_expert_comm=False."
        )
    check_overlap_schedule(owner, options.schedule)
    if ep == 1:
        raise ValueError(
            f"{owner}: pp_overlap_expert_comm=True with ep=1: the experts are local, so there is no all-to-all to "
            "overlap; set ep > 1, or pp_overlap_expert_comm=False."
        )
    if dispatcher not in _OVERLAP_DISPATCHERS:
        raise ValueError(
            f"{owner}: pp_overlap_expert_comm=True with dispatcher={dispatcher!r}: only the all-to-all dispatchers "
            f"{list(_OVERLAP_DISPATCHERS)} overlap their communication; choose one of them, or "
            "pp_overlap_expert_comm=False."
        )


def _reworded(owner: str, options: str, error: ValueError) -> ValueError:
    """A plan check's message under ``owner``'s name, with the strategy options that led to it."""
    message = str(error).split(": ", 1)[-1]
    return ValueError(f"{owner}: {message} (from {options})")


def check_pipeline_combination(
    owner: str, options: PipelineOptions, cp: int, sequence_parallel: bool, vocab_parallel: bool
) -> None:
    """At ``pp > 1`` the stages pass the hidden states (sharded along the sequence under sequence
    parallel, this CP rank's chunks under context parallel), not vocabulary shards of the logits."""
    if options.pp > 1 and vocab_parallel:
        raise ValueError(
            f"{owner}: vocab_parallel=True with pp={options.pp} is not supported (pipeline stages pass only the "
            "hidden states); set vocab_parallel=False or pp=1."
        )


def find_transformer(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """``(holder, transformer)``: the ``MoETransformer``-shaped model (``embed``, a ``ModuleList`` of
    ``layers``, ``norm``, ``lm_head``, ``config``) that is ``module`` (holder ``None``) or its
    ``model`` attribute (holder ``module``); ``(None, None)`` when there is none."""

    def shaped(m: Any) -> bool:
        parts = ("embed", "norm", "lm_head", "config")
        return isinstance(getattr(m, "layers", None), nn.ModuleList) and all(hasattr(m, p) for p in parts)

    if shaped(module):
        return None, module
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module) and shaped(inner):
        return module, inner
    return None, None


def check_pipeline_model(
    owner: str, options: PipelineOptions, module: nn.Module, *, cp: int = 1, sequence_parallel: bool = False
) -> None:
    """The module can be cut into ``pp * v`` stages: an MoETransformer-shaped model whose blocks
    split evenly, embeddings not tied (a Hugging Face causal LM: also the ``pp = 1`` checks of
    ``cp > 1`` and ``sequence_parallel``, :func:`check_hf_sharded_sequences`). ``ValueError``
    naming the fix (``TypeError`` for attention context parallel cannot wrap); nothing at ``pp = 1``."""
    if options.pp == 1 or cut_stages_of(module) is not None:  # cut already: by configure_model or an earlier fit
        return
    _, model = find_transformer(module)
    _, hf = find_hf_causal_lm(module) if model is None else (None, None)
    if model is None and hf is None:
        raise ValueError(
            f"{owner}: pp={options.pp} cuts an MoETransformer-shaped model (embed, layers, norm, lm_head, config) "
            f"or a Hugging Face causal LM into stages, but {type(module).__name__} is neither and has neither as "
            "its `model`; use MoELanguageModel or HFMoELanguageModel (or pass either model to fabric.setup), or set "
            "pp=1."
        )
    if hf is not None:
        _check_split(owner, options, hf_layer_count(owner, hf, options.pp))
        check_hf_sharded_sequences(owner, hf, cp, sequence_parallel)
        return
    if getattr(model.config, "tie_embeddings", False):
        raise ValueError(
            f"{owner}: tie_embeddings=True shares the embedding with the head, which sit on different pipeline "
            f"stages at pp={options.pp}; set tie_embeddings=False in the model config, or pp=1."
        )
    _check_split(owner, options, len(model.layers))


def check_hf_sharded_sequences(owner: str, hf: nn.Module, cp: int, sequence_parallel: bool) -> None:
    """The checks ``pp = 1`` makes of a Hugging Face causal LM under context and sequence parallel,
    made on the whole model before it is cut: its stages carry this rank's positions and document
    ids, so a family ``pp = 1`` takes with ``cp > 1`` or ``sequence_parallel`` runs at ``pp > 1``
    too, and one it refuses (gpt-oss's attention sinks under CP, DeepSeek's multi-head latent
    attention under sequence parallel) is refused with the same reason."""
    check_model_for_context_parallel(owner, hf, cp)
    if sequence_parallel:
        check_sequence_parallel_attention(hf, owner)


def _check_split(owner: str, options: PipelineOptions, num_layers: int) -> None:
    try:
        split_layers(num_layers, options.pp, options.virtual_stages)
    except ValueError as error:
        raise _reworded(owner, options.describe(), error) from None


def check_pipeline_batch(owner: str, options: PipelineOptions, batch_size: Any) -> None:
    """A batch of ``batch_size`` rows divides into the micro-batches (``None``: not known, no check)."""
    if options.pp == 1 or batch_size is None:
        return
    try:
        check_batch_split(batch_size, options.microbatches)
    except ValueError as error:
        raise _reworded(owner, options.describe(), error) from None


def check_pipeline_callbacks(owner: str, options: PipelineOptions, callbacks: list[Any]) -> None:
    """Refuse callbacks marked ``supports_pipeline_parallel = False`` at ``pp > 1``."""
    if options.pp == 1:
        return
    for callback in callbacks:
        if getattr(callback, "supports_pipeline_parallel", True) is False:
            raise ValueError(
                f"{owner}: the {type(callback).__name__} callback works on the whole model in one forward and "
                f"backward, which pp={options.pp} splits over stages and micro-batches; remove it or set pp=1."
            )


def check_pipeline_trainer(owner: str, options: PipelineOptions, trainer: Any) -> None:
    """At ``pp > 1``: the Trainer's callbacks (:func:`check_pipeline_callbacks`), and no fp16 loss
    scaling (the schedule runs the backward, so a ``GradScaler`` never scales it)."""
    if options.pp == 1:
        return
    check_pipeline_callbacks(owner, options, list(getattr(trainer, "callbacks", [])))
    if getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None:
        raise ValueError(
            f"{owner}: precision={trainer.precision!r} scales the loss for fp16, but at pp={options.pp} the pipeline "
            "schedule runs the backward without the scaler; use precision='bf16-mixed' or '32-true', or pp=1."
        )


def _rope(head_dim: int, theta: float, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return rope_tables(seq_len, head_dim, theta, device)


def _rope_at(
    head_dim: int, theta: float, position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``[B, S, D/2]`` at ``position_ids_BS``, or at positions restarting with each document."""
    if position_ids_BS is None:
        position_ids_BS = document_positions(document_ids_BS)  # type: ignore[arg-type]
    return rope_at_positions(position_ids_BS, head_dim, theta)


def cut_for_pipeline(
    owner: str, options: PipelineOptions, module: nn.Module, pp_rank: int, *, cp: int = 1,
    sequence_parallel: bool = False,
) -> tuple[nn.Module, LocalStages]:
    """Replace the transformer of ``module`` by this rank's stages; returns ``(module, stages)``
    (``module`` is the stages themselves when it was the transformer)."""
    check_pipeline_model(owner, options, module, cp=cp, sequence_parallel=sequence_parallel)
    holder, model = find_transformer(module)
    mine = stage_indices(pp_rank, options.pp, options.schedule, options.virtual_stages)
    if model is None:  # a Hugging Face causal LM (check_pipeline_model found one)
        hf_holder, hf = find_hf_causal_lm(module)
        ranges = split_layers(len(hf.model.layers), options.pp, options.virtual_stages)  # type: ignore[union-attr,arg-type]
        return cut_hf_for_pipeline(hf_holder, hf, ranges, mine)  # type: ignore[arg-type]
    cfg = model.config
    ranges = split_layers(len(model.layers), options.pp, options.virtual_stages)
    tables = functools.partial(_rope, cfg.head_dim, cfg.rope_theta)
    stages = cut_rank_stages(model, ranges, mine, tables, functools.partial(_rope_at, cfg.head_dim, cfg.rope_theta))
    if holder is None:
        return stages, stages
    holder.model = stages
    return holder, stages
