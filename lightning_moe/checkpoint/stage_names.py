"""Checkpoint names of a Hugging Face model cut into pipeline stages: the whole model's.

At ``pp > 1`` a swapped HF model is held as :class:`~lightning_moe.models.hf_pipeline_stage.HFLocalStages`,
whose parameters are named as the stages name them (``model.embed.weight``, ``model.layers.3.*``,
``model.norm.weight``, ``model.lm_head.weight`` under a LightningModule) instead of the HF model's
(``model.model.embed_tokens.weight``, ``model.model.layers.3.*``, ``model.model.norm.weight``,
``model.lm_head.weight``). :func:`hf_stage_renamer` gives the map from the first to the second,
which ``dcp.save_distributed`` and ``dcp.load_distributed`` apply to the model and optimizer
entries, so a DCP folder holds the whole model's names at every pipeline degree: it reshards
between ``pp=1`` and ``pp > 1`` and exports as any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from lightning_moe.models.hf_pipeline_stage import HFLocalStages, hf_parameter_name

__all__ = ["hf_stage_renamer", "renamed_model_state", "renamed_optimizer_state"]


def hf_stage_renamer(module: nn.Module) -> Callable[[str], str] | None:
    """The map from a name of ``module``'s state (model or optimizer entry) to the whole HF model's,
    or ``None`` when ``module`` holds no HF stages. Names outside the stages stay as they are."""
    prefixes = [f"{name}." if name else "" for name, m in module.named_modules() if isinstance(m, HFLocalStages)]
    if not prefixes:
        return None

    def rename(key: str) -> str:
        for prefix in prefixes:
            rest = key[len(prefix) :]
            if key.startswith(prefix) and rest.startswith(("embed.", "layers.", "norm.", "lm_head.")):
                return prefix + hf_parameter_name(rest)
        return key

    return rename


def renamed_model_state(state: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """``state`` keyed by ``rename(key)``, holding the same values (a DCP load into it fills ``state``)."""
    return {rename(k): v for k, v in state.items()}


def renamed_optimizer_state(state: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """An optimizer state dict (names as keys, ``get_optimizer_state_dict``) with its ``state`` keys
    and its param groups' ``params`` renamed; the per-parameter entries and the groups' other
    values are the same objects."""
    out = {**state, "state": renamed_model_state(state.get("state", {}), rename)}
    if "param_groups" in state:
        out["param_groups"] = [
            {**g, "params": [rename(p) for p in g["params"]]} if "params" in g else g for g in state["param_groups"]
        ]
    return out
