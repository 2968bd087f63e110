"""HFMoELanguageModel: train a Hugging Face MoE causal LM with lightning-moe's layers.

The model comes from an HF config given inline (a dict with ``model_type``, e.g. in YAML) or
from a local checkpoint directory (``config.json`` + safetensors). Its sparse-MoE blocks are
swapped for :class:`~lightning_moe.models.hf.HFMoELayer` (same weights, same routing), so the
``folded_moe`` strategy and the callbacks see ordinary :class:`MoELayer` s. Everything else —
logging, aux-loss scaling, expert-bias updates, AdamW with warm-up + cosine — comes from
:class:`~lightning_moe.lit.MoELanguageModelBase`, the base ``lightning-moe fit`` accepts models of.

Batches are ``{"input_ids", "labels"}`` with labels already shifted (``MoEDataModule``), so the
loss is computed here from the logits and HF's own label shifting is not used. Packed batches
(``packing="pack"``) add ``position_ids`` and ``document_ids``; ``forward`` then gives the model
a 4-D mask that keeps attention within each document
(:func:`~lightning_moe.models.hf.packed_forward_kwargs`). Under ``folded_moe`` with ``cp > 1`` the
model's attention runs across the context-parallel group (``models/hf_context_parallel.py``: this
rank's load-balanced chunks with their global ``position_ids``, documents masked by their ids) and
with ``sequence_parallel`` its residual stream is sharded over TP (``parallel/parallelize.py``);
``docs/hf_models.md`` lists the families that take each.

With ``load_sharded=True`` a ``pretrained`` model is built on the ``meta`` device and read in
``configure_model``: under ``folded_moe`` after ``parallelize_moe_model`` has laid it out, each
rank reading only its own slices of the safetensors shards
(:func:`~lightning_moe.checkpoint.hf_sharded.load_hf_checkpoint_sharded`); no rank holds the
whole model. At ``pp > 1`` the meta model is first cut into this rank's pipeline stages, and the
rank reads only the tensors of those stages.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
from typing_extensions import override

from lightning_moe.lit import MoELanguageModelBase
from lightning_moe.models.hf_config import hf_config_from

__all__ = ["HFMoELanguageModel", "build_hf_model", "hf_config_from"]

DtypeName = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_hf_model(
    hf_config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    dtype: DtypeName = "float32",
    attn_implementation: str | None = "sdpa",
    experts_implementation: str | None = None,
) -> nn.Module:
    """An ``AutoModelForCausalLM``: random init from ``hf_config``, or weights from ``pretrained``."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"HFMoELanguageModel: dtype={dtype!r} is unknown; choose one of {sorted(_DTYPES)}.")
    config = hf_config_from(hf_config, pretrained)
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    if pretrained is not None:
        return AutoModelForCausalLM.from_pretrained(pretrained, config=config, local_files_only=True, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def _meta_hf_model(pretrained: str | None, swap: bool, dtype: DtypeName, attn_implementation: str | None) -> nn.Module:
    """The ``pretrained`` model's skeleton on ``meta`` (its shard files checked, nothing read yet)."""
    from transformers import AutoModelForCausalLM

    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint

    if pretrained is None or not swap:
        raise ValueError(
            f"HFMoELanguageModel: load_sharded=True needs pretrained (a local checkpoint directory) and swap=True; "
            f"got pretrained={pretrained!r}, swap={swap}."
        )
    if dtype not in _DTYPES:
        raise ValueError(f"HFMoELanguageModel: dtype={dtype!r} is unknown; choose one of {sorted(_DTYPES)}.")
    HFCheckpoint(pretrained)  # a hub id, missing shards: refused before anything is built
    config = hf_config_from(None, pretrained)
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "HFMoELanguageModel: load_sharded=True with tie_word_embeddings=True is not supported; "
            "load this model with load_sharded=False."
        )
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def mark_experts_loaded(model: nn.Module) -> None:
    """Mark every MoE layer's experts as loaded: a strategy's ``expert_init_seed`` leaves them."""
    from lightning_moe.moe.utils import find_moe_layers

    for _, layer in find_moe_layers(model):
        layer.experts.seeded_or_loaded = True


class HFMoELanguageModel(MoELanguageModelBase):
    """Causal LM training of an HF MoE model whose MoE blocks are swapped for ours.

    Args:
        hf_config: inline HF config (dict with ``model_type``); or
        pretrained: local checkpoint directory (``config.json`` + safetensors).
        moe: :class:`~lightning_moe.config.MoEConfig` overrides for every swapped layer (e.g.
            ``{"aux_loss": "switch", "aux_loss_coeff": 0.01, "experts_backend": "torch"}``).
        swap: swap the MoE blocks (``False`` trains the HF model as it is, for comparison).
        dtype: dtype the HF model is built in (precision plugins may cast it later).
        attn_implementation: transformers attention backend (``sdpa``, ``eager``, ...).
        experts_implementation: transformers experts backend when ``swap=False``
            (``grouped_mm``, ``eager``, ...); unused for swapped blocks.
        fused_norms: compute the model's RMSNorms with one fused kernel each
            (:func:`~lightning_moe.models.hf_norms.swap_rms_norms`: same weights and checkpoint
            keys; in bf16 outputs differ from transformers' by about one unit in the last place).
        load_sharded: build the ``pretrained`` model on ``meta`` and read its weights in
            ``configure_model``, each rank only its shards under the strategy's layout (at
            ``pp > 1`` only its pipeline stages' tensors; needs ``pretrained`` and ``swap=True``;
            untied embeddings).
        options: :class:`~lightning_moe.lit.MoELanguageModelBase`'s arguments (``optimizer``,
            ``log_layer_load``, ...).
    """

    def __init__(
        self,
        hf_config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        moe: dict[str, Any] | None = None,
        swap: bool = True,
        dtype: DtypeName = "float32",
        attn_implementation: str | None = "sdpa",
        experts_implementation: str | None = None,
        fused_norms: bool = True,
        load_sharded: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.save_hyperparameters()
        if load_sharded:
            self.model = _meta_hf_model(pretrained, swap, dtype, attn_implementation)
        else:
            self.model = build_hf_model(hf_config, pretrained, dtype, attn_implementation, experts_implementation)
        if swap:
            from lightning_moe.models.hf import swap_moe_blocks

            swap_moe_blocks(self.model, **(moe or {}))
        elif moe:
            raise ValueError("HFMoELanguageModel: moe overrides need swap=True; drop moe or set swap=True.")
        if fused_norms:
            from lightning_moe.models.hf_norms import swap_rms_norms

            swap_rms_norms(self.model)
        if pretrained is not None and not load_sharded:  # the swapped experts hold the checkpoint's weights
            mark_experts_loaded(self.model)
        self.config = self.model.config

    @override
    def configure_model(self) -> None:
        """With ``load_sharded``: lay the meta model out (under ``folded_moe``), materialise this
        rank's shards and read them from ``pretrained``; otherwise nothing.

        At ``pp > 1`` the model is first cut into this rank's pipeline stages (as the strategy cuts
        it, ``strategies/pipeline_setup.py``), which are laid out on this pp coordinate's meshes; the
        rank then reads only its stages' tensors (the embedding on the first stage, its layers, the
        final norm and head on the last; of each only its EP, TP and FSDP slices) and the strategy
        keeps these stages. Non-persistent buffers (rotary frequencies, aux-loss counters) are set
        afresh, so every parameter and buffer is read or set; a tensor the checkpoint lacks raises
        ``ValueError`` naming it, and under ``folded_moe`` every other rank then raises too (one
        all-reduce of a flag), so no rank waits in a collective for one that stopped."""
        if not self.hparams.get("load_sharded") or not any(p.is_meta for p in self.model.parameters()):
            return
        from lightning_moe.checkpoint.hf_sharded import load_hf_checkpoint_sharded, reset_nonpersistent_buffers
        from lightning_moe.strategies._core import FoldedMoECore
        from lightning_moe.strategies.sharding import parallelize_module

        strategy = self._trainer.strategy if self._trainer is not None else None
        device = torch.device("cpu")
        if isinstance(strategy, FoldedMoECore):
            if strategy.pipeline_options.pp > 1:
                self._cut_into_stages(strategy)
            parallelize_module(self, strategy.module_plan)
            device = strategy.root_device  # type: ignore[attr-defined]
        elif strategy is not None:
            device = strategy.root_device
        error: ValueError | None = None
        with torch.device(device):
            self.model.to_empty(device=device)
            try:
                load_hf_checkpoint_sharded(self.model, self.hparams["pretrained"])
            except ValueError as problem:  # e.g. a tensor that only this rank's stage or experts need
                error = problem
            reset_nonpersistent_buffers(self.model)
        loaded_everywhere = error is None
        if isinstance(strategy, FoldedMoECore):
            loaded_everywhere = strategy.reduce_boolean_decision(loaded_everywhere, all=True)  # type: ignore[attr-defined]
        if error is not None:
            raise error
        if not loaded_everywhere:
            raise ValueError(
                f"HFMoELanguageModel: another rank could not load its part of {self.hparams['pretrained']!r} "
                "(its error names the tensors); every rank stops here."
            )
        mark_experts_loaded(self.model)

    def _cut_into_stages(self, strategy: Any) -> None:
        """``self.model`` becomes this rank's pipeline stages of the (meta) model, as the strategy
        would cut it in ``setup``."""
        from lightning_moe.strategies.pipeline_setup import cut_for_pipeline

        cut_for_pipeline(
            type(strategy).__name__, strategy.pipeline_options, self, strategy.folded_mesh.rank("pp"),
            cp=strategy.cp, sequence_parallel=strategy.sequence_parallel,
        )  # fmt: skip

    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]``. With ``document_ids`` ``[B, S]`` (packed rows) attention stays within each
        document and ``position_ids`` default to the position within it; ``position_ids`` alone are
        passed on as they are. Under context parallelism (``models/hf_context_parallel.py``) the ids are
        this rank's shard: ``position_ids`` (global) and ``document_ids`` go to the model's
        context-parallel attention, which masks by them instead of a 4-D mask."""
        from lightning_moe.models.hf_context_parallel import uses_hf_context_parallel

        if uses_hf_context_parallel(self.model):
            ids = {"position_ids": position_ids, "document_ids": document_ids}
            return self.model(input_ids=input_ids, use_cache=False, **{k: v for k, v in ids.items() if v is not None}).logits
        if document_ids is not None:
            from lightning_moe.models.hf import packed_forward_kwargs

            kwargs = packed_forward_kwargs(self.model, input_ids, document_ids, position_ids)
        else:
            kwargs = {} if position_ids is None else {"position_ids": position_ids}
        return self.model(input_ids=input_ids, use_cache=False, **kwargs).logits

    def num_active_params(self) -> int:
        """Parameters one token touches (top-k of each layer's routed experts), excluding embeddings.
        At ``pp > 1`` (the model cut into this rank's stages) those of this rank's stages."""
        from lightning_moe.moe.utils import find_moe_layers

        cut = not hasattr(self.model, "get_input_embeddings")  # pipeline stages: embed, layers, norm, lm_head
        embed = getattr(self.model, "embed", None) if cut else self.model.get_input_embeddings()
        skip = {id(p) for p in embed.parameters()} if embed is not None else set()
        experts = {}
        for _, layer in find_moe_layers(self.model):
            for p in layer.experts.parameters():
                experts[id(p)] = layer.config.top_k / layer.config.num_experts
        total = 0.0
        for p in self.model.parameters():
            if id(p) in skip:
                continue
            total += p.numel() * experts.get(id(p), 1.0)
        head = getattr(self.model, "lm_head", None) if cut else self.model.get_output_embeddings()
        if head is not None and id(head.weight) in skip:  # tied: the output projection still costs flops
            total += head.weight.numel()
        return int(total)
