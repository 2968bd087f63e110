"""The names one swapped MoE layer's tensors have in an HF safetensors checkpoint, per family.

Legend: E experts, H hidden, F expert FFN width, ``P`` the block's checkpoint prefix.

transformers 5 holds fused experts in memory (``experts.gate_up_proj [E, 2F, H]``) but its
``save_pretrained`` writes most families the way their original checkpoints are laid out (the
reverse of its ``conversion_mapping``). :func:`saved_layer_names` gives those names from the
family table (:data:`~lightning_moe.models.hf_families.FAMILIES`: router path, correction bias,
shared expert and its gate) and the few renames below; :func:`module_layer_names` gives the
in-memory names (a ``state_dict`` written as it is). The sharded loader reads either; the
streaming export writes the saved ones, so a checkpoint loads and exports back bit for bit.

=============================  ===================================================================
family                         experts and router as saved (``P`` = the block's module path unless
                               noted)
=============================  ===================================================================
most (Qwen2/3-MoE, DeepSeek,   ``P.experts.{i}.gate_proj.weight [F, H]``, ``up_proj``, ``down_proj
GLM-4, dots1, OLMoE, ERNIE,    [H, F]``; router ``P.<router>.weight``; bias ``P.<router>.<bias>``
HunYuan, Qwen3-Next/3.5)
ERNIE-4.5                      bias ``P.moe_statics.e_score_correction_bias`` (not under ``gate``)
Mixtral, MiniMax               ``P`` is ``...block_sparse_moe`` (module ``...mlp``); experts
                               ``w1`` (gate), ``w3`` (up), ``w2`` (down)
Granite-MoE                    fused ``P.input_linear.weight [E, 2F, H]``, ``P.output_linear.weight
                               [E, H, F]``; router ``P.router.layer.weight``
Llama 4                        fused, transposed: ``P.experts.gate_up_proj [E, H, 2F]``,
                               ``P.experts.down_proj [E, F, H]``
gpt-oss                        as Llama 4, gate and up columns interleaved (gate ``[..., ::2]``),
                               biases ``P.experts.gate_up_proj_bias [E, 2F]`` (interleaved too),
                               ``P.experts.down_proj_bias [E, H]``; router bias ``P.router.bias``
=============================  ===================================================================

Shared experts (``P.<shared>.gate_proj/up_proj/down_proj.weight``) and their gates
(``P.<shared_gate>.weight``) keep their module names in every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_moe.models.hf_families import FAMILIES, Family
from lightning_moe.models.hf_routing import _correction_bias

__all__ = ["CHECKPOINT_RENAMES", "CheckpointRenames", "LayerNames", "family_named", "module_layer_names",
           "saved_layer_names", "stored_bias_shape"]  # fmt: skip


@dataclass(frozen=True)
class CheckpointRenames:
    """Where ``save_pretrained`` departs from the module names for one family (module doc).

    Attributes:
        block: ``(module attribute, checkpoint attribute)`` of the block in its decoder layer.
        per_expert: ``(gate, up, down)`` attribute names of the per-expert ``experts.{i}.*.weight``;
            ``None`` when the experts are saved fused.
        fused: ``(gate_up, down)`` names, under ``P.``, of the fused expert tensors when saved fused.
        router: the router weight's name under ``P.`` (default ``<router>.weight``).
        bias: the correction bias's name under ``P.`` (default ``<router>.<bias>``).
    """

    block: tuple[str, str] | None = None
    per_expert: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    fused: tuple[str, str] | None = None
    router: str | None = None
    bias: str | None = None


_MIXTRAL = CheckpointRenames(block=("mlp", "block_sparse_moe"), per_expert=("w1", "w3", "w2"))
_GRANITE = CheckpointRenames(per_expert=None, fused=("input_linear.weight", "output_linear.weight"),
                             router="router.layer.weight")
CHECKPOINT_RENAMES: dict[str, CheckpointRenames] = {
    "mixtral": _MIXTRAL,
    "minimax": _MIXTRAL,
    "ernie4_5_moe": CheckpointRenames(bias="moe_statics.e_score_correction_bias"),
    "granitemoe": _GRANITE,
    "llama4": CheckpointRenames(per_expert=None, fused=("experts.gate_up_proj", "experts.down_proj")),
    "minimax_m2": _MIXTRAL,
    "kimi_linear": _MIXTRAL,
    "lfm2_moe": CheckpointRenames(per_expert=("w1", "w3", "w2")),
    "exaone_moe": CheckpointRenames(bias="e_score_correction_bias"),
    "granitemoeshared": _GRANITE,
    "granitemoehybrid": _GRANITE,
    "gpt_oss": CheckpointRenames(per_expert=None, fused=("experts.gate_up_proj", "experts.down_proj")),
}  # fmt: skip
_BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES.values()}


@dataclass(frozen=True)
class LayerNames:
    """The checkpoint names of one swapped layer's tensors.

    ``fused`` set: the experts are two tensors ``(gate_up, down)`` (``transposed``: ``[E, H, 2F]``
    / ``[E, F, H]``, else ``[E, 2F, H]`` / ``[E, H, F]``; ``interleaved``: gate and up alternate
    along the ``2F`` dim) with biases ``expert_biases`` (``[E, 2F]``, ``[E, H]``, when the layer
    has them); else per expert, :meth:`expert`. ``router_bias``: the router's own bias, if any.
    """

    prefix: str
    router: str
    bias: str | None
    shared: str | None
    shared_gate: str | None
    per_expert: tuple[str, str, str] | None
    fused: tuple[str, str] | None
    transposed: bool
    interleaved: bool = False
    router_bias: str | None = None
    expert_biases: tuple[str, str] | None = None

    def expert(self, i: int) -> tuple[str, str, str]:
        """``(gate, up, down)`` weight names of expert ``i`` (``[F, H]``, ``[F, H]``, ``[H, F]``)."""
        assert self.per_expert is not None
        return tuple(f"{self.prefix}experts.{i}.{n}.weight" for n in self.per_expert)  # type: ignore[return-value]


def family_named(name: str, owner: str) -> Family:
    """The swappable family called ``name``; ``ValueError`` naming the known ones otherwise."""
    fam = _BY_NAME.get(name)
    if fam is None or fam.refused is not None:
        known = sorted(f.name for f in FAMILIES.values() if f.refused is None)
        raise ValueError(f"{owner}: family {name!r} has no HF checkpoint names here; known: {known}.")
    return fam


def _renamed_prefix(layer_name: str, renames: CheckpointRenames) -> str:
    parent, _, attr = layer_name.rpartition(".")
    if renames.block is not None and attr == renames.block[0]:
        attr = renames.block[1]
    return f"{parent}.{attr}." if parent else f"{attr}."


def _names(layer_name: str, fam: Family, renames: CheckpointRenames, prefix: str) -> LayerNames:
    return LayerNames(
        prefix=prefix,
        router=prefix + (renames.router or f"{fam.router}.weight"),
        bias=None if fam.bias is None else prefix + (renames.bias or fam.bias),
        shared=None if fam.shared is None else f"{prefix}{fam.shared}.",
        shared_gate=None if fam.shared_gate is None else f"{prefix}{fam.shared_gate}.weight",
        per_expert=renames.per_expert,
        fused=None if renames.fused is None else (prefix + renames.fused[0], prefix + renames.fused[1]),
        transposed=fam.experts_transposed,
        interleaved=bool(getattr(fam, "gate_up_interleaved", False)),
        router_bias=f"{prefix}{fam.router}.bias",
        expert_biases=None if renames.fused is None else (f"{prefix}{renames.fused[0]}_bias",
                                                          f"{prefix}{renames.fused[1]}_bias"),
    )  # fmt: skip


def saved_layer_names(layer_name: str, family: str, owner: str = "hf checkpoint") -> LayerNames:
    """The names transformers' ``save_pretrained`` gives the layer at module path ``layer_name``."""
    fam = family_named(family, owner)
    renames = CHECKPOINT_RENAMES.get(fam.name, CheckpointRenames())
    return _names(layer_name, fam, renames, _renamed_prefix(layer_name, renames))


def module_layer_names(layer_name: str, family: str, owner: str = "hf checkpoint") -> LayerNames:
    """The in-memory (``state_dict``) names: fused ``experts.gate_up_proj`` / ``experts.down_proj``."""
    fam = family_named(family, owner)
    fused = CheckpointRenames(per_expert=None, fused=("experts.gate_up_proj", "experts.down_proj"))
    return _names(layer_name, fam, fused, f"{layer_name}.")


def stored_bias_shape(layer: Any) -> tuple[int, ...] | None:
    """The shape of a swapped layer's correction bias in its HF block (ERNIE keeps ``[1, E]``, ours
    is ``[E]``); ``None`` when the family has none."""
    bias = _correction_bias(family_named(layer.family, "hf checkpoint"), layer.hf_block)
    return None if bias is None else tuple(bias.shape)
