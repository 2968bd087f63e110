"""The LightningModules: :class:`MoELanguageModelBase` and :class:`MoELanguageModel`.

:class:`MoELanguageModelBase` holds what every causal-LM module of this package shares; a
subclass builds its network as ``self.model`` in its own ``__init__`` and defines ``forward``
(``input_ids`` -> logits). :class:`MoELanguageModel` trains an :class:`MoETransformer`;
:class:`~lightning_moe.lit_hf.HFMoELanguageModel` an HF model with our MoE layers swapped in.

The base logs ``train/loss``, ``train/ppl``, every aux loss summed over layers, and the per-layer load
imbalance ``max(c)/mean(c)`` of routed tokens per expert; ``val/loss`` and ``val/ppl``.
``train/loss`` and the ``val/`` values are means over all ranks (one all-reduce each), the number a
one-process run would log.

Under ``strategy="folded_moe"`` each batch goes through the strategy's ``shard_batch`` first:
with ``cp > 1`` this rank's load-balanced sequence chunks with their global ``position_ids``
(``parallel/fold_batch.py``); ``position_ids`` and ``document_ids`` of a batch (packed
documents) reach ``forward``. The loss is ``lm_cross_entropy`` (``parallel/vocab.py``: the
vocab-parallel cross-entropy when the head is vocab-parallel), summed over this rank's labelled
tokens and divided by the labelled tokens of the whole step's batch on all data-parallel and
context-parallel ranks (one all-reduce of one number), times ``dp*cp``: FSDP's gradient average
over ``dp x cp`` is then the gradient of the mean over every labelled token, as one process
computes it, whatever ``ignore_index`` labels or packing leave on each rank. ``train/ppl`` and the aux losses are logged unsynchronised
(rank 0's value reaches the logger). It also keeps the MoE layers' bookkeeping in step with the
optimizer: aux-loss gradient scale (``1/accumulate_grad_batches``, times the fp16 loss scale),
expert-bias updates and global-aux-loss counts, once per optimizer step.

Pipeline parallel (``FoldedMoEStrategy(pp=2, ...)``): ``training_step`` hands the batch to the
strategy's ``pipeline``, whose schedule runs the forward and backward of every micro-batch
(the strategy then skips its own backward) and returns the loss one process would log: the
batch's token mean, broadcast to every stage; validation runs the stages forward only. The aux
losses and per-layer loads logged at ``pp > 1`` are the whole model's over the batch's
micro-batches: each aux loss the sum over layers of its mean over the micro-batches, each load
imbalance from the routed tokens summed over the micro-batches (one all-reduce over the pp
group per step). ``self.device_mesh`` is the
strategy's device mesh (``strategy="folded_moe"``: the dense mesh) from ``configure_model`` on.
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_warn
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from typing_extensions import override

from lightning_moe.checkpoint.hparams import config_from_plain, config_to_plain
from lightning_moe.checkpoint.read import join_consolidated
from lightning_moe.checks import check_bool
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.optimizer import OptimizerConfig, build_adamw, optimizer_config_from
from lightning_moe.parallel.finite import NonFiniteGuard, forwarded_nonfinite_options, guard_closure, world_group
from lightning_moe.parallel.rank_mean import mean_over_ranks
from lightning_moe.parallel.fold_batch import lm_token_mean_loss
from lightning_moe.parallel.vocab import vocab_parallel_head
from lightning_moe.moe.utils import find_moe_layers, reset_global_aux_counts, set_aux_loss_scale, update_expert_biases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MoELanguageModel",
    "MoELanguageModelBase",
    "check_vocab",
    "check_wgrad_fusion",
]

_EXPERT_BIASES = ("experts.b13", "experts.b2")  # MoEConfig.expert_mlp_bias: no weight decay, as other biases
_DEPRECATED_ARGUMENTS = (
    "learning_rate", "weight_decay", "warmup_steps", "betas", "optimizer_impl", "guard_nonfinite", "skip_nonfinite",
)  # fmt: skip


def check_vocab(owner: str, model_vocab: int | None, datamodule: Any) -> None:
    """Refuse a model whose embedding is smaller than the data module's token-id range."""
    data_vocab = getattr(datamodule, "vocab_size", None)
    if not isinstance(model_vocab, int) or not isinstance(data_vocab, int) or model_vocab >= data_vocab:
        return
    raise ValueError(
        f"{owner}: model vocab_size={model_vocab} is smaller than {type(datamodule).__name__}'s "
        f"vocab_size={data_vocab} (token ids up to {data_vocab - 1} would index past the embedding); "
        f"set the model's vocab_size to {data_vocab} or more."
    )


# Strategies whose gradient reduction hangs on hooks of the gradient accumulator nodes, which the
# in-place expert gradient accumulation (MoEConfig.fuse_wgrad_accumulation) bypasses.
_ACCUMULATOR_HOOK_STRATEGIES = (DDPStrategy, FSDPStrategy, DeepSpeedStrategy)


def check_wgrad_fusion(module: torch.nn.Module, strategy: Any) -> None:
    """Refuse ``fuse_wgrad_accumulation`` under a strategy whose gradient hooks it would bypass."""
    fused = [name for name, m in module.named_modules() if getattr(m, "fuse_wgrad_accumulation", False)]
    if fused and isinstance(strategy, _ACCUMULATOR_HOOK_STRATEGIES):
        raise ValueError(
            f"MoEConfig(fuse_wgrad_accumulation=True) (at {fused[0]!r}) cannot train under "
            f"{type(strategy).__name__}: it reduces gradients from hooks on the gradient accumulators, which "
            "in-place accumulation bypasses. Use strategy='folded_moe' (FSDP2) or one device, or set "
            "fuse_wgrad_accumulation=False."
        )


class MoELanguageModelBase(L.LightningModule):
    """Causal language modelling on ``batch["input_ids"]`` / ``batch["labels"]`` (labels shifted).

    A subclass builds ``self.model`` (the network whose MoE layers are logged and kept in step)
    after calling this ``__init__`` (it passes its own ``**options`` on), then saves its
    hyper-parameters, and defines ``forward``.

    Args:
        optimizer: AdamW and its warm-up + cosine schedule
            (:class:`~lightning_moe.optimizer.OptimizerConfig`, or a dict of its fields; YAML
            ``optimizer: {learning_rate: 3e-3, warmup_steps: 30}``). Default: ``OptimizerConfig()``.
        log_layer_load: log each MoE layer's ``max/mean`` routed-token load.
        learning_rate, weight_decay, warmup_steps, betas, optimizer_impl: deprecated spellings of
            ``optimizer``'s fields (mapped into it with a ``DeprecationWarning``; not together with
            ``optimizer``).
        guard_nonfinite, skip_nonfinite: deprecated here; the strategy owns the non-finite guard
            (``FoldedMoEStrategy(guard_nonfinite=..., skip_nonfinite=...)``, ``parallel/finite.py``).
            Given here they are forwarded to ``folded_moe`` with a ``DeprecationWarning``. Under a
            strategy of another package, which has no guard, this module runs it before every
            optimizer step with these options (default: on, raising at the first non-finite step).
            ``MoEConfig.check_finite`` is a different, opt-in check: router logits in every
            layer's forward.
    """

    model: torch.nn.Module

    def __init__(
        self,
        optimizer: OptimizerConfig | None = None,
        log_layer_load: bool = True,
        *,
        learning_rate: float | None = None,
        weight_decay: float | None = None,
        warmup_steps: int | None = None,
        betas: tuple[float, float] | None = None,
        optimizer_impl: str | None = None,
        guard_nonfinite: bool | None = None,
        skip_nonfinite: int | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        flat = {"learning_rate": learning_rate, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                "betas": betas, "optimizer_impl": optimizer_impl}  # fmt: skip
        self.optimizer_config = optimizer_config_from(owner, optimizer, flat)
        check_bool(owner, "log_layer_load", log_layer_load)
        self.log_layer_load = log_layer_load
        self.forwarded_nonfinite_options = forwarded_nonfinite_options(owner, guard_nonfinite, skip_nonfinite)
        options = {"guard_nonfinite": True, "skip_nonfinite": 0, **self.forwarded_nonfinite_options}
        guard_on, skip = options["guard_nonfinite"], options["skip_nonfinite"]
        self._nonfinite_guard = NonFiniteGuard(owner, skip) if guard_on else None  # under other strategies
        self.val_history: list[tuple[int, float]] = []
        self._val_sum = torch.zeros(2)

    @override
    def save_hyperparameters(self, *args: Any, frame: Any = None, **kwargs: Any) -> None:
        """Lightning's, then the optimizer's arguments stored as one ``optimizer`` entry (the config)."""
        super().save_hyperparameters(*args, frame=frame or inspect.currentframe().f_back, **kwargs)  # type: ignore[union-attr]
        for name in _DEPRECATED_ARGUMENTS:
            self._hparams.pop(name, None)
        self._hparams["optimizer"] = self.optimizer_config
        self._hparams["log_layer_load"] = self.log_layer_load
        self._hparams_initial = copy.deepcopy(self._hparams)

    @property
    @override
    def device_mesh(self) -> DeviceMesh | None:
        """The Trainer strategy's device mesh (``strategy="folded_moe"``: the dense mesh, axes ``pp dp cp tp``).

        Read it in ``configure_model`` or a later hook: under a strategy that builds a mesh, reading
        it before the strategy's ``setup_environment`` raises ``RuntimeError``. ``None`` when the
        module is not attached to a Trainer or its strategy has no mesh (one device, DDP).
        """
        if self._trainer is None:
            return None
        strategy = self._trainer.strategy
        if not hasattr(type(strategy), "device_mesh"):
            return None
        return strategy.device_mesh  # type: ignore[attr-defined]

    # --- Lightning hooks ---------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        check_wgrad_fusion(self, self.trainer.strategy)
        model_vocab = getattr(getattr(self, "config", None), "vocab_size", None)
        check_vocab(type(self).__name__, model_vocab, self.trainer.datamodule)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        pipeline = self._pipeline()
        if pipeline is not None:  # forward and backward of every micro-batch; the loss is detached
            accumulate = self.trainer.accumulate_grad_batches
            if batch_idx % accumulate == 0:  # Lightning zeroes after the step: see optimizer_zero_grad
                for optimizer in self.trainer.optimizers:
                    optimizer.zero_grad()
            loss = pipeline.train_step(batch, accumulate)
        else:
            set_aux_loss_scale(self.model, self._aux_loss_scale())
            loss = self._lm_loss(batch)
        # One all-reduce and no barrier: sync_dist=True would add a barrier, which on NCCL waits for the
        # device to drain the forward and leaves it idle until the host has launched the backward.
        self.log("train/loss", mean_over_ranks(loss.detach()), prog_bar=True)
        self.log("train/ppl", torch.exp(loss.detach().clamp(max=30)))
        self._log_moe_stats()
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._lm_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss.clamp(max=30)), sync_dist=True)
        self._val_sum += torch.stack([loss.detach().float().cpu(), torch.ones(())])
        return loss

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The logits ``[B, S, V]`` of ``batch["input_ids"]`` (with the batch's ``position_ids`` and
        ``document_ids``, packed documents); ``labels`` are not read. At ``pp > 1`` the micro-batches
        run forward through the stages and every rank returns the logits the last stage computed.
        Refused under context parallel (each CP rank holds chunks of the sequence) and with a
        vocab-parallel head (each TP rank holds a slice of the vocabulary)."""
        pipeline = self._pipeline()
        if pipeline is not None:
            return pipeline.predict_step(batch)
        strategy = self.trainer.strategy if self._trainer is not None else None
        context = getattr(strategy, "context_parallel", None)
        if context is not None and context.size > 1:
            raise ValueError(
                f"{type(self).__name__}.predict_step: cp={context.size} would return each CP rank's sequence chunks; "
                "predict with cp=1 (a checkpoint saved at any cp loads at cp=1)."
            )
        if vocab_parallel_head(self.model) is not None:
            raise ValueError(
                f"{type(self).__name__}.predict_step: the head is vocab-parallel, so each TP rank holds a slice of "
                "the logits; predict with vocab_parallel=False (the checkpoint loads either way)."
            )
        extra = {k: batch[k] for k in ("position_ids", "document_ids") if batch.get(k) is not None}
        return self(batch["input_ids"], **extra)

    @override
    def on_validation_epoch_start(self) -> None:
        self._val_sum.zero_()

    @override
    def on_validation_epoch_end(self) -> None:
        # Kept also during the sanity check, which gives the loss before the first step.
        if self._val_sum[1] > 0:
            self.val_history.append((self.global_step, float(self._val_sum[0] / self._val_sum[1])))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Config dataclasses in the hyper-parameters become plain dicts (``weights_only`` loads); the
        optimizer config is stored as the dict of its fields, which the constructor takes back."""
        if "hyper_parameters" in checkpoint:
            hparams = config_to_plain(checkpoint["hyper_parameters"])
            if isinstance(hparams.get("optimizer"), OptimizerConfig):
                hparams = {**hparams, "optimizer": hparams["optimizer"].as_dict()}
            checkpoint["hyper_parameters"] = hparams

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A DCP folder made one file by Lightning's ``consolidate_checkpoint`` loads like a Lightning
        checkpoint (``join_consolidated``: ``w13``'s gate/up halves joined, its optimizers as
        ``optimizer_states``); other checkpoints are unchanged."""
        join_consolidated(checkpoint)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        strategy = self.trainer.strategy if self._trainer is not None else None
        guard = self._nonfinite_guard
        if guard is not None and optimizer_closure is not None and not getattr(strategy, "owns_nonfinite_guard", False):
            scaler = getattr(self.trainer.precision_plugin, "scaler", None) if strategy is not None else None
            device = strategy.root_device if strategy is not None else self.device
            optimizer_closure = guard_closure(
                guard, optimizer_closure, self, world_group(), device, self.global_step,
                check_gradients=scaler is None or not scaler.is_enabled(), on_skip=rank_zero_warn,
            )  # fmt: skip
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        group = getattr(self.trainer.strategy, "expert_bias_group", None) if self._trainer is not None else None
        update_expert_biases(self.model, group)
        reset_global_aux_counts(self.model)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning's, except at ``pp > 1``: Lightning zeroes the gradients between the training
        step and the backward, but the pipeline's training step has run the backward already, so
        ``training_step`` zeroes them itself before the schedule (first batch of an accumulation)."""
        if self._pipeline() is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def configure_optimizers(self) -> Any:
        """AdamW from :attr:`optimizer_config` (no decay for vectors and per-expert biases) with its
        warm-up + cosine schedule over ``max_steps`` (10 000 steps when unset), stepped every step."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            is_bias = name.endswith(_EXPERT_BIASES)  # [E, ...] per-expert biases: biases, not matrices
            (decay if p.dim() >= 2 and not is_bias else no_decay).append(p)
        total = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else 10_000
        optimizer, scheduler = build_adamw(self.optimizer_config, decay, no_decay, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- helpers -----------------------------------------------------------------------------

    def _pipeline(self) -> Any:
        """The strategy's pipeline at ``pp > 1`` (``strategies/pipeline_step.py``), else ``None``."""
        strategy = self.trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "pipeline", None)

    def _lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pipeline = self._pipeline()
        if pipeline is not None:  # validation: forward only through the stages
            return pipeline.eval_step(batch)
        strategy = self.trainer.strategy if self._trainer is not None else None
        shard = getattr(strategy, "shard_batch", None)
        if shard is not None:
            batch = shard(batch)
        extra = {k: batch[k] for k in ("position_ids", "document_ids") if batch.get(k) is not None}
        logits_BSV = self(batch["input_ids"], **extra)
        group, ranks = getattr(strategy, "loss_group", (None, 1))
        return lm_token_mean_loss(self.model, logits_BSV, batch["labels"], group, ranks)

    def _aux_loss_scale(self) -> float:
        if self._trainer is None:
            return 1.0
        scale = 1.0 / max(self.trainer.accumulate_grad_batches, 1)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale *= float(scaler.get_scale())
        return scale

    def _log_moe_stats(self) -> None:
        """Every aux loss summed over the MoE layers, and each layer's load imbalance. At ``pp > 1``
        the whole model's, every stage and micro-batch (``PipelineRunner.moe_stats``, a collective
        over the pp group); else this rank's layers' last forward."""
        pipeline = self._pipeline()
        if pipeline is not None:
            stats = pipeline.moe_stats()
            totals, loads = dict(stats.aux), dict(stats.tokens)
        else:
            totals, loads = {}, {}
            for name, layer in find_moe_layers(self.model):
                for key, value in layer.last_aux_losses.items():
                    totals[key] = totals.get(key, 0) + value
                if layer.last_tokens_per_expert is not None:
                    loads[name] = layer.last_tokens_per_expert
        if self.log_layer_load:
            for name, counts in loads.items():
                counts = counts.float()
                self.log(f"load_imbalance/{name}", counts.max() / counts.mean().clamp(min=1e-9))
        for key, value in totals.items():
            self.log(f"train/{key}", value)


class MoELanguageModel(MoELanguageModelBase):
    """Causal language modelling with an :class:`MoETransformer`.

    Args:
        model: the transformer's shape (vocabulary, layers, MoE config).
        options: :class:`MoELanguageModelBase`'s arguments (``optimizer``, ``log_layer_load``, ...).
    """

    def __init__(self, model: TransformerConfig, **options: Any) -> None:
        if isinstance(model, dict):  # a checkpoint's hyper-parameters store configs as plain dicts
            model = config_from_plain(model)
        super().__init__(**options)
        self.save_hyperparameters()
        self.config = model
        self.model = MoETransformer(model)

    @override
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if position_ids is None and document_ids is None:
            return self.model(input_ids)
        return self.model(input_ids, position_ids, document_ids)
