"""MoEMonitor: expert load, EP-rank load, dropped tokens, router entropy and aux losses.

Legend: L MoE layers, E experts, P ranks of the expert-parallel (EP) group.

Stages:

1. ``on_train_start`` (after the strategy has sharded the model): read every layer's
   dispatcher (``ep_size``, ``ep_group``; 1 and ``None`` for the local dispatcher) and build the
   torchmetrics Metrics of :mod:`lightning_moe.metrics` on the module's device.
2. ``on_train_batch_end``, every micro-batch: update the metrics from the hooks each
   :class:`~lightning_moe.MoELayer` publishes (``last_tokens_per_expert``,
   ``last_dropped_fraction``, ``last_router_entropy``, ``last_aux_losses``) and, when the
   dispatcher publishes it, ``last_rows_per_ep_rank`` (rows sent to each EP rank; ECHO's
   dispatcher does). Without it, EP-rank load is the routed tokens of each rank's experts.
3. Every ``log_every_n_steps`` optimizer steps: ``compute`` (collectives: sums over the token
   group — ``dp_cp`` under ``folded_moe``, the default group otherwise — and over the EP group;
   every rank takes part), log through ``pl_module.log`` (the summary
   ``moe/expert_load_max_over_mean`` also to the progress bar), then reset.
4. Every ``heatmap_every_n_steps`` optimizer steps, rank zero writes a layer x expert heatmap of
   ``load / mean load`` to ``<trainer.log_dir>/moe_load/step<N>.png``, and to TensorBoard
   (``add_image("moe/load_heatmap")``) when the first logger is a ``TensorBoardLogger``.

Logged names: ``moe/expert_load_max_over_mean`` and ``moe/ep_load_max_over_mean`` (mean over
layers), ``moe/router_entropy`` (nats, mean over layers), ``moe/dropped_fraction`` (when a layer
has a capacity), ``moe/<aux loss>`` (summed over layers), and with ``per_layer`` the same
per layer as ``<name>/<layer>`` plus ``moe/tokens_max/<layer>`` and ``moe/tokens_mean/<layer>``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_moe.callbacks._layers import require_moe_layers
from lightning_moe.metrics import (
    ExpertLoad,
    LayerMean,
    RankLoad,
    max_over_mean,
    rank_load_from_experts,
)
from lightning_moe.moe.layer import MoELayer

__all__ = ["MoEMonitor", "render_heatmap", "token_group"]

SUMMARY = "moe/expert_load_max_over_mean"


def token_group(trainer: L.Trainer) -> Any:
    """Ranks holding different tokens: the strategy's ``dp_cp`` group when it has a FoldedMesh.

    ``None`` (the default group) otherwise: under DDP every rank holds different tokens.
    """
    for attr in ("folded_mesh", "mesh"):
        try:
            mesh = getattr(trainer.strategy, attr, None)
        except RuntimeError:  # FoldedMoEStrategy before setup_environment
            mesh = None
        if mesh is not None and callable(getattr(mesh, "group", None)) and callable(getattr(mesh, "size", None)):
            return mesh.group("dp_cp") if mesh.size("dp_cp") > 1 else None
    return None


def render_heatmap(load_LE: torch.Tensor, layer_names: list[str], title: str) -> Any:
    """A matplotlib Figure of ``load / mean load`` per layer (rows) and expert (columns).

    Uses the object-oriented API with an Agg canvas (no pyplot global state, no display).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    load_LE = load_LE.double()
    rel_LE = (load_LE / load_LE.mean(-1, keepdim=True).clamp(min=1e-12)).cpu().numpy()
    L_, E = rel_LE.shape
    fig = Figure(figsize=(max(4.0, 0.25 * E + 2.5), max(2.0, 0.35 * L_ + 1.2)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(rel_LE, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0)
    ax.set_xlabel("expert")
    ax.set_yticks(range(L_))
    ax.set_yticklabels(layer_names, fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="load / mean")
    fig.tight_layout()
    return fig



def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

class MoEMonitor(Callback):
    """Log MoE load statistics and draw a layer x expert load heatmap.

    Args:
        log_every_n_steps: compute (synchronise), log and reset every this many optimizer steps;
            statistics accumulate over the micro-batches in between. What reaches the logger is
            still filtered by the Trainer's own ``log_every_n_steps``.
        heatmap_every_n_steps: write a heatmap PNG every this many optimizer steps; ``None`` is
            off (and then matplotlib is not needed).
        per_layer: log each layer's values too, not only the summaries.
        prog_bar: show ``moe/expert_load_max_over_mean`` in the progress bar.
    """

    supports_pipeline_parallel = False  # acts on one forward and backward of the whole model

    def __init__(
        self,
        log_every_n_steps: int = 1,
        heatmap_every_n_steps: int | None = 100,
        per_layer: bool = True,
        prog_bar: bool = True,
    ) -> None:
        if not _is_int(log_every_n_steps) or log_every_n_steps < 1:
            raise ValueError(f"MoEMonitor: log_every_n_steps={log_every_n_steps!r} must be >= 1; use e.g. 10.")
        if heatmap_every_n_steps is not None and (not _is_int(heatmap_every_n_steps) or heatmap_every_n_steps < 1):
            raise ValueError(
                f"MoEMonitor: heatmap_every_n_steps={heatmap_every_n_steps!r} must be >= 1, or None for no heatmap."
            )
        self.log_every_n_steps = log_every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.per_layer = per_layer
        self.prog_bar = prog_bar
        self._layers: list[tuple[str, MoELayer]] = []
        self._ep_size = 1
        self._log_dir: Path | None = None
        self._last_global_step = 0
        self.expert_load: ExpertLoad | None = None
        self.rank_load: RankLoad | None = None
        self.dropped: LayerMean | None = None
        self.entropy: LayerMean | None = None
        self.aux: dict[str, LayerMean] = {}
        self._group: Any = None
        # what the last compute produced (also handy for tests and notebooks)
        self.last_tokens_per_expert: torch.Tensor | None = None  # [L, E]
        self.last_rank_load: torch.Tensor | None = None  # [L, P]
        self.last_values: dict[str, float] = {}
        self.heatmaps: list[Path] = []

    # --- Lightning hooks ------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._layers = require_moe_layers("MoEMonitor", pl_module)
        for _, layer in self._layers:
            layer.record_router_entropy = True  # the layer skips this [T, E] pass unless asked
        if self.heatmap_every_n_steps is not None and importlib.util.find_spec("matplotlib") is None:
            raise ModuleNotFoundError(
                f"MoEMonitor: heatmap_every_n_steps={self.heatmap_every_n_steps} needs matplotlib; "
                "pip install 'lightning-moe[monitor]', or set heatmap_every_n_steps=None."
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After strategy.setup: the dispatchers are the sharded ones now.
        self._layers = require_moe_layers("MoEMonitor", pl_module)
        dispatchers = [layer.dispatcher for _, layer in self._layers]
        ep_sizes = {d.ep_size for d in dispatchers}
        if len(ep_sizes) != 1:
            raise ValueError(
                f"MoEMonitor: the MoE layers use different EP sizes {sorted(ep_sizes)}; the monitor needs one EP size."
            )
        self._ep_size = ep_sizes.pop()
        ep_group = getattr(dispatchers[0], "ep_group", None)
        self._group = token_group(trainer)
        num_layers, num_experts = len(self._layers), self._layers[0][1].config.num_experts
        if any(layer.config.num_experts != num_experts for _, layer in self._layers):
            raise ValueError("MoEMonitor: the MoE layers have different num_experts; the heatmap needs one E.")
        device = pl_module.device
        self.expert_load = ExpertLoad(num_layers, num_experts, process_group=self._group).to(device)
        self.rank_load = RankLoad(num_layers, self._ep_size, process_group=ep_group).to(device)
        self.dropped = LayerMean(num_layers, process_group=self._group).to(device)
        self.entropy = LayerMean(num_layers, process_group=self._group).to(device)
        self.aux = {}
        self._last_global_step = trainer.global_step
        # trainer.log_dir broadcasts: every rank must ask, so ask here and keep the answer.
        log_dir = trainer.log_dir if self.heatmap_every_n_steps is not None else None
        self._log_dir = Path(log_dir) if log_dir is not None else None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.expert_load is None:
            return
        self._update(pl_module.device)
        step = trainer.global_step
        stepped, self._last_global_step = step != self._last_global_step, step
        if not stepped:
            return
        want_heatmap = self.heatmap_every_n_steps is not None and step % self.heatmap_every_n_steps == 0
        if step % self.log_every_n_steps == 0 or want_heatmap:
            self._compute_and_log(pl_module)
            if want_heatmap:
                self._write_heatmap(trainer, step)
            self._reset()

    # --- internals ------------------------------------------------------------------------------

    def _update(self, device: torch.device) -> None:
        L_, E = len(self._layers), self._layers[0][1].config.num_experts
        tokens_LE = torch.zeros(L_, E, dtype=torch.int64, device=device)
        rows_LP = torch.zeros(L_, self._ep_size, dtype=torch.int64, device=device)
        dropped_L = torch.zeros(L_, device=device)
        has_dropped_L = torch.zeros(L_, dtype=torch.bool, device=device)
        entropy_L = torch.zeros(L_, device=device)
        has_entropy_L = torch.zeros(L_, dtype=torch.bool, device=device)
        aux: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (_, layer) in enumerate(self._layers):
            if layer.last_tokens_per_expert is not None:
                tokens_LE[i] = layer.last_tokens_per_expert.to(device)
            published = getattr(layer.dispatcher, "last_rows_per_ep_rank", None)
            if published is not None:
                rows_LP[i] = published.to(device)
            else:
                rows_LP[i] = rank_load_from_experts(tokens_LE[i : i + 1], self._ep_size)[0]
            if layer.last_dropped_fraction is not None:
                dropped_L[i], has_dropped_L[i] = layer.last_dropped_fraction.to(device), True
            entropy = getattr(layer, "last_router_entropy", None)
            if entropy is not None:
                entropy_L[i], has_entropy_L[i] = entropy.to(device), True
            for name, value in layer.last_aux_losses.items():
                values_L, present_L = aux.setdefault(
                    name, (torch.zeros(L_, device=device), torch.zeros(L_, dtype=torch.bool, device=device))
                )
                values_L[i], present_L[i] = value.to(device), True
        self.expert_load.update(tokens_LE)  # type: ignore[union-attr]
        self.rank_load.update(rows_LP)  # type: ignore[union-attr]
        self.dropped.update(dropped_L, has_dropped_L)  # type: ignore[union-attr]
        self.entropy.update(entropy_L, has_entropy_L)  # type: ignore[union-attr]
        for name, (values_L, present_L) in sorted(aux.items()):
            if name not in self.aux:
                self.aux[name] = LayerMean(len(self._layers), process_group=self._group).to(device)
            self.aux[name].update(values_L, present_L)

    def _compute_and_log(self, pl_module: L.LightningModule) -> None:
        # Collectives: every rank computes, in the same order.
        tokens_LE = self.expert_load.compute().cpu()  # type: ignore[union-attr]  # SYNC: small [L, E]
        rows_LP = self.rank_load.compute().cpu()  # type: ignore[union-attr]
        dropped_L, has_dropped = self.dropped.compute().cpu(), bool(self.dropped.count_L.sum() > 0)  # type: ignore[union-attr]
        entropy_L = self.entropy.compute().cpu()  # type: ignore[union-attr]
        aux = {name: metric.compute().cpu() for name, metric in sorted(self.aux.items())}
        self.last_tokens_per_expert, self.last_rank_load = tokens_LE, rows_LP

        expert_ratio_L, ep_ratio_L = max_over_mean(tokens_LE), max_over_mean(rows_LP)
        values: dict[str, float] = {
            SUMMARY: float(expert_ratio_L.mean()),
            "moe/ep_load_max_over_mean": float(ep_ratio_L.mean()),
            "moe/router_entropy": float(entropy_L.mean()),
        }
        if has_dropped:
            values["moe/dropped_fraction"] = float(dropped_L.mean())
        for name, values_L in aux.items():
            values[f"moe/{name}"] = float(values_L.sum())
        if self.per_layer:
            for i, (layer_name, _) in enumerate(self._layers):
                values[f"{SUMMARY}/{layer_name}"] = float(expert_ratio_L[i])
                values[f"moe/ep_load_max_over_mean/{layer_name}"] = float(ep_ratio_L[i])
                values[f"moe/tokens_max/{layer_name}"] = float(tokens_LE[i].max())
                values[f"moe/tokens_mean/{layer_name}"] = float(tokens_LE[i].double().mean())
                values[f"moe/router_entropy/{layer_name}"] = float(entropy_L[i])
                if has_dropped:
                    values[f"moe/dropped_fraction/{layer_name}"] = float(dropped_L[i])
                for name, values_L in aux.items():
                    values[f"moe/{name}/{layer_name}"] = float(values_L[i])
        self.last_values = values
        for name, value in values.items():
            pl_module.log(
                name,
                value,
                on_step=True,
                on_epoch=False,
                prog_bar=self.prog_bar and name == SUMMARY,
                sync_dist=False,  # already summed over the right group above
                batch_size=1,
            )

    @rank_zero_only
    def _write_heatmap(self, trainer: L.Trainer, step: int) -> None:
        if self.last_tokens_per_expert is None or self._log_dir is None:
            return
        names = [name for name, _ in self._layers]
        fig = render_heatmap(self.last_tokens_per_expert, names, f"tokens per expert / mean, step {step}")
        out_dir = self._log_dir / "moe_load"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"step{step:08d}.png"
        fig.savefig(path)
        self.heatmaps.append(path)
        logger = trainer.logger
        if isinstance(logger, TensorBoardLogger):
            import numpy as np

            fig.canvas.draw()
            image_HWC = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
            logger.experiment.add_image("moe/load_heatmap", image_HWC, global_step=step, dataformats="HWC")

    def _reset(self) -> None:
        for metric in (self.expert_load, self.rank_load, self.dropped, self.entropy, *self.aux.values()):
            if metric is not None:
                metric.reset()
