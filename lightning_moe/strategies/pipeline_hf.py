"""Pipeline parallel of a Hugging Face causal LM in a folded strategy: finding it, checking it, cutting it.

A swapped HF MoE model (``HFMoELanguageModel.model``, or the model given to ``fabric.setup``) is cut
by :func:`~lightning_moe.models.hf_pipeline_stage.cut_hf_rank_stages` into this rank's
:class:`~lightning_moe.models.hf_pipeline_stage.HFLocalStages`; ``strategies/pipeline_setup.py``
calls these functions when the module holds no ``MoETransformer``-shaped model.

- :func:`find_hf_causal_lm`: the HF model (an ``nn.Linear`` ``lm_head`` and a ``config`` with a
  ``model_type``) that is the module (holder ``None``) or its ``model`` attribute;
- :func:`hf_layer_count`: its decoder layer count once :func:`check_hf_pipeline_model` accepts
  the family (tied embeddings, hybrid and vision-language families refused with the reason);
- :func:`cut_hf_for_pipeline`: this rank's stages, placed where the model was;
- :func:`restore_hf_buffers`: the rotary frequencies (non-persistent buffers) of stages
  materialised from the ``meta`` device, which an empty materialisation leaves undefined;
- :func:`hf_stages_cut_already`: the stages of a module that ``configure_model`` cut, laid out and
  loaded itself (``HFMoELanguageModel(load_sharded=True)``: each rank reads only its stages'
  tensors), which the strategy then keeps instead of cutting again.

Parameter names of the stages are :class:`~lightning_moe.parallel.pipeline_stage.TransformerStage`'s
(``embed.weight``, ``layers.N.*``, ``norm.weight``, ``lm_head.weight``), not the HF model's; the
Trainer strategy's DCP checkpoints store them under the HF model's names
(``checkpoint/stage_names.py``), so they reshard between ``pp=1`` and ``pp > 1`` and export as any
other.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from lightning_moe.checkpoint.hf_sharded import reset_nonpersistent_buffers
from lightning_moe.models.hf_pipeline_stage import HFLocalStages, check_hf_pipeline_model, cut_hf_rank_stages
from lightning_moe.parallel.pipeline_stage import cut_stages_of

__all__ = [
    "cut_hf_for_pipeline",
    "find_hf_causal_lm",
    "hf_layer_count",
    "hf_stages_cut_already",
    "restore_hf_buffers",
]


def _is_hf_causal_lm(m: Any) -> bool:
    return isinstance(getattr(m, "lm_head", None), nn.Linear) and hasattr(getattr(m, "config", None), "model_type")


def find_hf_causal_lm(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """``(holder, hf)``: the HF causal LM that is ``module`` (holder ``None``) or its ``model``
    attribute (holder ``module``); ``(None, None)`` when there is none."""
    if _is_hf_causal_lm(module):
        return None, module
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module) and _is_hf_causal_lm(inner):
        return module, inner
    return None, None


def hf_layer_count(owner: str, hf: nn.Module, pp: int) -> int:
    """The decoder layer count of ``hf`` if its family can be cut into stages; ``ValueError``
    under ``owner``'s name with the reason and the fix otherwise."""
    try:
        check_hf_pipeline_model(hf)
    except ValueError as error:
        reason = str(error).split(": ", 1)[-1].rstrip(".")
        raise ValueError(f"{owner}: {reason} (pp={pp}); or set pp=1.") from None
    return len(hf.model.layers)  # type: ignore[union-attr,arg-type] # checked above


def cut_hf_for_pipeline(
    holder: nn.Module | None, hf: nn.Module, ranges: tuple[range, ...], mine: tuple[int, ...]
) -> tuple[nn.Module, HFLocalStages]:
    """This rank's stages of ``hf`` (``ranges[i]`` for ``i`` in ``mine``) as ``holder.model``;
    returns ``(holder, stages)``, or ``(stages, stages)`` when ``hf`` had no holder (Fabric)."""
    stages = cut_hf_rank_stages(hf, ranges, mine)
    if holder is None:
        return stages, stages
    holder.model = stages
    return holder, stages


def restore_hf_buffers(stages: nn.Module) -> None:
    """In HF stages materialised from the ``meta`` device (their buffers undefined after
    ``to_empty``): the rotary frequencies a fresh HF model computes, the aux-loss counters zeroed.
    Other stages are left as they are."""
    if isinstance(stages, HFLocalStages):
        reset_nonpersistent_buffers(stages)


def hf_stages_cut_already(owner: str, module: nn.Module, mine: tuple[int, ...]) -> tuple[HFLocalStages, int] | None:
    """``(stages, hidden_size)`` when ``module`` (or its ``model`` attribute) is already this rank's
    HF stages (``mine``: the stage indices this rank holds), ``None`` when it is not cut.
    ``ValueError`` for stages cut for another pipeline layout."""
    stages = cut_stages_of(module)
    if not isinstance(stages, HFLocalStages):
        return None
    held = tuple(index for index, _ in stages.stages)
    if held != tuple(mine) or not held:
        raise ValueError(
            f"{owner}: {type(module).__name__} holds pipeline stages {held} already, cut for another layout than "
            f"this rank's stages {tuple(mine)}; build the model again for this strategy."
        )
    return stages, int(stages.stages[0][1].config.hidden_size)
