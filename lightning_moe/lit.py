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
expert-bias updates and global-aux-loss counts, once per optimizer step. ``self.device_mesh`` is the
strategy's device mesh (``strategy="folded_moe"``: the dense mesh) from ``configure_model`` on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.fabric.utilities.rank_zero import rank_zero_warn
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from typing_extensions import override

from lightning_moe.checkpoint.hparams import config_from_plain, config_to_plain
from lightning_moe.checks import check_bool, check_float, check_int
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.optimizer import adamw_kernel_kwargs, check_optimizer_impl, unscale_before_step
from lightning_moe.parallel.finite import NonFiniteGuard, check_nonfinite_options, guard_closure, world_group
from lightning_moe.parallel.rank_mean import mean_over_ranks
from lightning_moe.parallel.fold_batch import lm_token_mean_loss
from lightning_moe.moe.utils import find_moe_layers, reset_global_aux_counts, set_aux_loss_scale, update_expert_biases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MoELanguageModel",
    "MoELanguageModelBase",
    "check_optimizer_args",
    "check_optimizer_impl",
    "check_vocab",
    "check_wgrad_fusion",
]

_EXPERT_BIASES = ("experts.b13", "experts.b2")  # MoEConfig.expert_mlp_bias: no weight decay, as other biases


def check_optimizer_args(
    owner: str, learning_rate: Any, weight_decay: Any, warmup_steps: Any, betas: Any, log_layer_load: Any
) -> None:
    """The AdamW and schedule arguments, checked at construction (torch would refuse them at the first step)."""
    check_float(owner, "learning_rate", learning_rate, fix="use e.g. 3e-3")
    check_float(owner, "weight_decay", weight_decay, fix="use 0 or more, e.g. 0.1")
    check_int(owner, "warmup_steps", warmup_steps, minimum=0, fix="use 0 (no warm-up) or more")
    if (
        isinstance(betas, (str, bytes))
        or not hasattr(betas, "__len__")
        or len(betas) != 2
        or not all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{owner}: betas={betas!r} must be two numbers in [0, 1); use e.g. betas=(0.9, 0.95).")
    check_bool(owner, "log_layer_load", log_layer_load)


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
    after calling this ``__init__``, then saves its hyper-parameters, and defines ``forward``.

    Args:
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to norms, biases and the router's expert bias).
        warmup_steps: linear warm-up steps, then cosine decay to 10 % over ``max_steps``.
        betas: AdamW betas.
        log_layer_load: log each MoE layer's ``max/mean`` routed-token load.
        optimizer_impl: AdamW kernels: ``fused`` (one kernel per step and dtype), ``foreach``, or
            ``auto`` = fused when every parameter is on CUDA, else torch's default.
        guard_nonfinite: before every optimizer step (and before clipping), a NaN/inf loss or
            gradient raises ``FloatingPointError`` naming the first parameter and module holding it;
            no weight changes (``parallel/finite.py``: local shards, one 16-byte all-reduce over the
            world; measured: 4 % of a tiny-model CPU step). ``MoEConfig.check_finite`` is a different,
            opt-in check: router logits in every layer's forward.
        skip_nonfinite: skip up to this many non-finite steps in a row instead (gradients dropped,
            the optimizer changes nothing, the step still counts toward ``global_step`` and the LR
            schedule; each is logged as a warning), raising at the next; 0 raises at the first.
            Under ``strategy="folded_moe"`` the strategy runs the guard, with these options unless
            the strategy sets different ones (two different non-default settings are an error).
    """

    model: torch.nn.Module

    def __init__(
        self,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        betas: tuple[float, float] = (0.9, 0.95),
        log_layer_load: bool = True,
        optimizer_impl: str = "auto",
        guard_nonfinite: bool = True,
        skip_nonfinite: int = 0,
    ) -> None:
        super().__init__()
        check_optimizer_impl(optimizer_impl, type(self).__name__)
        check_optimizer_args(type(self).__name__, learning_rate, weight_decay, warmup_steps, betas, log_layer_load)
        check_nonfinite_options(type(self).__name__, guard_nonfinite, skip_nonfinite)
        self.nonfinite_options = (guard_nonfinite, skip_nonfinite)
        self._nonfinite_guard = NonFiniteGuard(type(self).__name__, skip_nonfinite) if guard_nonfinite else None
        self.val_history: list[tuple[int, float]] = []
        self._val_sum = torch.zeros(2)

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
    def on_validation_epoch_start(self) -> None:
        self._val_sum.zero_()

    @override
    def on_validation_epoch_end(self) -> None:
        # Kept also during the sanity check, which gives the loss before the first step.
        if self._val_sum[1] > 0:
            self.val_history.append((self.global_step, float(self._val_sum[0] / self._val_sum[1])))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Config dataclasses in the hyper-parameters become plain dicts (``weights_only`` loads)."""
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = config_to_plain(checkpoint["hyper_parameters"])

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        strategy = self.trainer.strategy if self._trainer is not None else None
        guard = self._nonfinite_guard
        if guard is not None and optimizer_closure is not None and not getattr(strategy, "guards_nonfinite", False):
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
    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            is_bias = name.endswith(_EXPERT_BIASES)  # [E, ...] per-expert biases: biases, not matrices
            (decay if p.dim() >= 2 and not is_bias else no_decay).append(p)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            **adamw_kernel_kwargs(hp.get("optimizer_impl", "auto"), decay + no_decay),
        )
        unscale_before_step(optimizer)  # clipping under every precision plugin (lightning_moe.optimizer)
        total = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else 10_000
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(hp.warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- helpers -----------------------------------------------------------------------------

    def _lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
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
        totals: dict[str, torch.Tensor] = {}
        for name, layer in find_moe_layers(self.model):
            for key, value in layer.last_aux_losses.items():
                totals[key] = totals.get(key, 0) + value
            counts = layer.last_tokens_per_expert
            if self.hparams.log_layer_load and counts is not None:
                counts = counts.float()
                self.log(f"load_imbalance/{name}", counts.max() / counts.mean().clamp(min=1e-9))
        for key, value in totals.items():
            self.log(f"train/{key}", value)


class MoELanguageModel(MoELanguageModelBase):
    """Causal language modelling with an :class:`MoETransformer`.

    Args:
        model: the transformer's shape (vocabulary, layers, MoE config).
        learning_rate, weight_decay, warmup_steps, betas, log_layer_load, optimizer_impl,
            guard_nonfinite, skip_nonfinite: as in :class:`MoELanguageModelBase`.
    """

    def __init__(
        self,
        model: TransformerConfig,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        betas: tuple[float, float] = (0.9, 0.95),
        log_layer_load: bool = True,
        optimizer_impl: str = "auto",
        guard_nonfinite: bool = True,
        skip_nonfinite: int = 0,
    ) -> None:
        if isinstance(model, dict):  # a checkpoint's hyper-parameters store configs as plain dicts
            model = config_from_plain(model)
        super().__init__(
            learning_rate, weight_decay, warmup_steps, betas, log_layer_load, optimizer_impl,
            guard_nonfinite, skip_nonfinite,
        )  # fmt: skip
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



def _warmup_cosine(warmup: int, total: int):  # noqa: ANN202 - returns a LambdaLR schedule
    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule
