"""One pipeline stage of a decoder-only transformer, cut from the model's public attributes.

Legend: B batch, S sequence, H hidden, V vocabulary.

A model with ``embed``, ``layers`` (a ModuleList of blocks called as ``block(x_BSH, cos, sin)``),
``norm``, ``lm_head`` and ``config.tie_embeddings`` (``MoETransformer``) is cut without copying:
:func:`build_transformer_stage` returns a :class:`TransformerStage` holding the model's own
embedding (first stage), its slice of blocks, and the final norm and head (last stage). Parameter
names stay the model's (``embed.weight``, ``layers.3.attn.q_proj.weight``, ``lm_head.weight``), so
a stage's state dict is a slice of the model's. Build the model under ``torch.device("meta")``
and each rank allocates only its stages (:func:`materialize_stage`).

``forward(x, position_ids=None, document_ids=None)``: the first stage takes token ids ``[B, S]``,
the others the hidden states ``[B, S, H]`` of the stage before; the last returns logits
``[B, S, V]``, the others hidden states. The per-token ids ``[B, S]`` reach every stage as keyword
arguments (the pipeline schedule splits them into micro-batches like the token ids), and each stage
builds its RoPE and document mask from them as ``MoETransformer.forward`` does: RoPE at
``position_ids`` (``rope_positions``), or at the positions restarting with each document of
``document_ids``, or for ``0..S-1`` with the ``rope_tables(S, device)`` it was given when neither
is passed. Under context parallel ``position_ids`` are this rank's global positions (required);
under sequence parallel the hidden states hold ``S/tp`` positions while the ids cover all ``S``.

A pipeline rank may hold several stages (interleaved and "V" schedules): :func:`cut_rank_stages`
returns a :class:`LocalStages`, the one module that owns this rank's embedding, blocks (a
``ModuleDict`` keyed by the global block index), norm and head under the model's parameter names,
and the :class:`TransformerStage` view of each of its stages (sharing those modules), which the
schedule runs. The optimizer, FSDP, checkpoints and clipping see ``LocalStages``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from lightning_moe.moe.layer import MoELayer

__all__ = [
    "LocalStages",
    "RopePositions",
    "RopeTables",
    "TransformerStage",
    "build_transformer_stage",
    "check_stage_range",
    "cut_rank_stages",
    "cut_stages_of",
    "materialize_stage",
]

RopeTables = Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
# (position_ids, document_ids) -> cos, sin [B, S, D/2]; positions restart per document when None
RopePositions = Callable[[torch.Tensor | None, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class TransformerStage(nn.Module):
    """The embedding (first stage), a contiguous run of blocks, and the norm and head (last stage)."""

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        rope_tables: RopeTables,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        rope_positions: RopePositions | None = None,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleDict({str(i): block for i, block in sorted(blocks.items())})
        self.norm = norm
        self.lm_head = lm_head
        self.rope_tables = rope_tables
        self.rope_positions = rope_positions

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x_BSH = self.embed(x) if self.embed is not None else x
        if position_ids is None and document_ids is None:
            cos_SD, sin_SD = self.rope_tables(x_BSH.shape[1], x_BSH.device)
        elif self.rope_positions is None:
            raise ValueError(
                f"{type(self).__name__}: per-token ids were passed but the stage was built without rope_positions; "
                "build it with rope_positions (cut_rank_stages does) or pass no position_ids / document_ids."
            )
        else:
            cos_SD, sin_SD = self.rope_positions(position_ids, document_ids)
        # the attention gets the ids only when there are any (as MoETransformer's blocks do)
        extra = () if position_ids is None and document_ids is None else (document_ids, position_ids)
        for block in self.layers.values():
            x_BSH = block(x_BSH, cos_SD, sin_SD, *extra)
        if self.lm_head is None:
            return x_BSH
        return self.lm_head(self.norm(x_BSH))


def check_stage_range(owner: str, layers: object, num_layers: int, model_layers: int, fix: str) -> None:
    """``ValueError`` unless the model has ``num_layers`` blocks and ``layers`` is a non-empty
    contiguous ``range`` inside them (``fix``: the expression that gives the model's count)."""
    if model_layers != num_layers:
        raise ValueError(f"{owner}: num_layers={num_layers} but the model has {model_layers} blocks; pass {fix}.")
    if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
        raise ValueError(
            f"{owner}: layers={layers!r} must be a non-empty range(start, stop) inside "
            f"[0, {num_layers}); pass one entry of split_layers(...)."
        )


def build_transformer_stage(
    model: Any, layers: range, num_layers: int, rope_tables: RopeTables, rope_positions: RopePositions | None = None
) -> TransformerStage:
    """The stage of ``model`` that runs blocks ``layers`` (first stage if it starts at 0, last if it
    ends at ``num_layers``). Shares the model's modules; raises ``ValueError`` for a model without
    the attributes or with tied embeddings split over two stages."""
    for name in ("embed", "layers", "norm", "lm_head", "config"):
        if not hasattr(model, name):
            raise ValueError(
                f"build_transformer_stage: model {type(model).__name__} has no attribute {name!r}; "
                "pass a model with embed, layers, norm, lm_head and config (MoETransformer)."
            )
    check_stage_range("build_transformer_stage", layers, num_layers, len(model.layers), "len(model.layers)")
    first, last = layers.start == 0, layers.stop == num_layers
    if getattr(model.config, "tie_embeddings", False) and first != last:
        raise ValueError(
            "build_transformer_stage: tie_embeddings=True shares the embedding with the head, which sit on "
            "different pipeline stages; set tie_embeddings=False for pipeline parallel."
        )
    return TransformerStage(
        {i: model.layers[i] for i in layers},
        rope_tables,
        embed=model.embed if first else None,
        norm=model.norm if last else None,
        lm_head=model.lm_head if last else None,
        rope_positions=rope_positions,
    )


class LocalStages(nn.Module):
    """This pipeline rank's part of a transformer: the embedding (if it holds the first stage), its
    blocks under their global indices, the norm and head (if it holds the last stage).

    ``stages`` lists ``(stage_index, TransformerStage)`` views sharing these modules, in increasing
    stage order; they are kept out of the module tree, so each parameter has one name, the model's.
    """

    def __init__(self, stages: list[tuple[int, TransformerStage]]) -> None:
        super().__init__()
        firsts = [v for _, v in stages if v.is_first]
        lasts = [v for _, v in stages if v.is_last]
        self.embed = firsts[0].embed if firsts else None
        blocks = {int(k): b for _, v in stages for k, b in v.layers.items()}
        self.layers = nn.ModuleDict({str(i): blocks[i] for i in sorted(blocks)})
        self.norm = lasts[0].norm if lasts else None
        self.lm_head = lasts[0].lm_head if lasts else None
        self.stages = list(stages)

    def forward(self, *args: Any) -> torch.Tensor:
        raise RuntimeError(
            "LocalStages: a pipeline rank's stages run through the pipeline schedule, not as one module; "
            "call the strategy's pipeline (training_step of MoELanguageModel does)."
        )


def cut_stages_of(module: nn.Module) -> LocalStages | None:
    """This rank's stages when ``module`` (or its ``model`` attribute) was cut already (by
    ``configure_model`` or an earlier fit), else ``None``."""
    stages = module if isinstance(module, LocalStages) else getattr(module, "model", None)
    return stages if isinstance(stages, LocalStages) else None


def cut_rank_stages(
    model: Any,
    ranges: tuple[range, ...],
    mine: tuple[int, ...],
    rope_tables: RopeTables,
    rope_positions: RopePositions | None = None,
) -> LocalStages:
    """The stages ``mine`` (indices into ``ranges``, from ``stage_indices``) of ``model`` as one
    :class:`LocalStages`. Each MoE layer is told its index among the whole model's MoE layers
    (``global_moe_index``), so per-expert seeding does not depend on the cut."""
    ordinal = 0
    for block in model.layers:
        for m in block.modules():
            if isinstance(m, MoELayer):
                m.global_moe_index = ordinal
                ordinal += 1
    num_layers = len(model.layers)
    views = [(s, build_transformer_stage(model, ranges[s], num_layers, rope_tables, rope_positions)) for s in mine]
    return LocalStages(views)


def materialize_stage(stage: nn.Module, device: torch.device | str, init_std: float) -> nn.Module:
    """Allocate a stage built on the meta device on ``device`` and initialise it as ``MoETransformer``
    does: weights of two or more dims ``normal(0, init_std)``, norm weights one, other vectors and
    every buffer (counters, expert biases) zero."""
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=init_std)
            elif "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
        for b in stage.buffers():
            b.zero_()
    return stage
