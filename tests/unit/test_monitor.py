"""MoEMonitor on constructed routing: forced expert ids, zero router weights, a fake EP size.

Setup shared by the value tests (learning rate 0, so every step routes alike):

* router weights are zero -> probabilities are uniform over E=4 experts, so the router entropy
  is ``log 4``, the switch loss of a layer is exactly its coefficient (``E/(K T^2) * sum_i c_i
  * T/E = 1`` times the coefficient, whatever the counts) and the z-loss is
  ``coeff * (log 4)^2``;
* layer 0 is forced to send every token to experts {0, 1}; layer 1 sends token t to
  {t mod 4, t+1 mod 4} (balanced);
* 2 micro-batches of 2 x 8 tokens per optimizer step, top-2: 64 routed slots per layer and step.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _callback_models import tiny_config, tiny_trainer, token_loader
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from PIL import Image

from lightning_moe.callbacks import MoEMonitor
from lightning_moe.callbacks.monitor import SUMMARY
from lightning_moe.lit import MoELanguageModel
from lightning_moe.moe.dispatch import LocalDispatcher
from lightning_moe.moe.utils import find_moe_layers

AUX, Z = 0.01, 1e-3
L0, L1 = "model.layers.0.ffn", "model.layers.1.ffn"


class ListLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self, save_dir: Path) -> None:
        super().__init__()
        self._save_dir = str(save_dir)
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class FakeEPDispatcher(LocalDispatcher):
    """All experts local, but claims EP size 2: experts {0, 1} on "rank" 0, {2, 3} on "rank" 1."""

    ep_size = 2
    ep_group = None


def _constructed_model(capacity_factor: float | None = None, fake_ep: bool = False) -> MoELanguageModel:
    L.seed_everything(0, verbose=False)
    moe: dict[str, Any] = {
        "aux_loss": "switch",
        "aux_loss_coeff": AUX,
        "z_loss_coeff": Z,
        "capacity_factor": capacity_factor,
    }
    model = MoELanguageModel(tiny_config(**moe), learning_rate=0.0, warmup_steps=1, weight_decay=0.0)
    for i, (_, layer) in enumerate(find_moe_layers(model)):
        layer.router.weight.data.zero_()
        if fake_ep:
            layer.dispatcher = FakeEPDispatcher(4)
        if i == 0:
            layer.router.set_routing_override(lambda ids: torch.tensor([0, 1]).expand_as(ids).clone())
        else:
            layer.router.set_routing_override(
                lambda ids: torch.stack([torch.arange(ids.shape[0]) % 4, (torch.arange(ids.shape[0]) + 1) % 4], 1)
            )
    return model


def _fit(root: Path, monitor: MoEMonitor, model: L.LightningModule, max_steps: int = 2, **kw: Any) -> L.Trainer:
    trainer = tiny_trainer(root, [monitor], max_steps=max_steps, accumulate_grad_batches=2, log_every_n_steps=1, **kw)
    trainer.fit(model, train_dataloaders=token_loader())
    return trainer


def test_values_on_forced_routing_with_capacity_and_fake_ep(tmp_path: Path) -> None:
    monitor = MoEMonitor(heatmap_every_n_steps=1)
    logger = ListLogger(tmp_path)
    trainer = _fit(tmp_path, monitor, _constructed_model(capacity_factor=1.0, fake_ep=True), logger=logger)

    assert monitor.last_tokens_per_expert.tolist() == [[32, 32, 0, 0], [16, 16, 16, 16]]
    assert monitor.last_rank_load.tolist() == [[64, 0], [32, 32]]
    v = monitor.last_values
    assert v[f"{SUMMARY}/{L0}"] == 2.0 and v[f"{SUMMARY}/{L1}"] == 1.0 and v[SUMMARY] == 1.5
    assert v[f"moe/ep_load_max_over_mean/{L0}"] == 2.0 and v["moe/ep_load_max_over_mean"] == 1.5
    assert v[f"moe/tokens_max/{L0}"] == 32 and v[f"moe/tokens_mean/{L0}"] == 16
    # capacity ceil(16*2/4 * 1.0) = 8 per expert and micro-batch: layer 0 keeps 8 of 16 on experts 0 and 1
    assert v[f"moe/dropped_fraction/{L0}"] == 0.5 and v[f"moe/dropped_fraction/{L1}"] == 0.0
    assert v["moe/dropped_fraction"] == 0.25
    assert v[f"moe/router_entropy/{L0}"] == pytest.approx(math.log(4), abs=1e-6)
    assert v["moe/router_entropy"] == pytest.approx(math.log(4), abs=1e-6)
    assert v["moe/load_balancing_loss"] == pytest.approx(2 * AUX, rel=1e-5)
    assert v[f"moe/z_loss/{L1}"] == pytest.approx(Z * math.log(4) ** 2, rel=1e-5)

    logged = [metrics for _, metrics in logger.calls if SUMMARY in metrics]
    assert len(logged) == 2 and all(m[SUMMARY] == pytest.approx(1.5) for m in logged)
    assert SUMMARY in trainer.progress_bar_metrics

    pngs = sorted((tmp_path / "moe_load").glob("*.png"))
    assert [p.name for p in pngs] == ["step00000001.png", "step00000002.png"]
    with Image.open(pngs[-1]) as image:
        image.load()
        assert image.format == "PNG" and image.width > 100 and image.height > 50


def test_dropless_layers_log_no_dropped_fraction_and_one_ep_rank(tmp_path: Path) -> None:
    monitor = MoEMonitor(heatmap_every_n_steps=None, per_layer=False)
    _fit(tmp_path, monitor, _constructed_model(), max_steps=1)
    assert "moe/dropped_fraction" not in monitor.last_values
    assert monitor.last_rank_load.tolist() == [[64], [64]]
    assert monitor.last_values["moe/ep_load_max_over_mean"] == 1.0
    assert not any("/model.layers" in k for k in monitor.last_values)


def test_heatmap_reaches_tensorboard_as_an_image(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    _fit(tmp_path, MoEMonitor(heatmap_every_n_steps=1), _constructed_model(), max_steps=1, logger=logger)
    assert (Path(logger.log_dir) / "moe_load" / "step00000001.png").is_file()
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert "moe/load_heatmap" in events.Tags()["images"]


def test_logging_interval_accumulates_steps_between_logs(tmp_path: Path) -> None:
    monitor = MoEMonitor(log_every_n_steps=2, heatmap_every_n_steps=None)
    _fit(tmp_path, monitor, _constructed_model(), max_steps=2)
    assert monitor.last_tokens_per_expert.tolist() == [[64, 64, 0, 0], [32, 32, 32, 32]]  # two steps summed


def test_model_without_moe_layer_is_refused_with_the_fix(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, [MoEMonitor()], max_steps=1)
    with pytest.raises(ValueError, match=r"MoEMonitor: BoringModel holds no .*MoELayer.*swap_moe_blocks"):
        trainer.fit(BoringModel())


def test_missing_matplotlib_is_reported_with_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(
        ModuleNotFoundError, match=r"heatmap_every_n_steps=5 needs matplotlib.*lightning-moe\[monitor\]"
    ):
        MoEMonitor(heatmap_every_n_steps=5).setup(None, _constructed_model(), "fit")  # type: ignore[arg-type]
    MoEMonitor(heatmap_every_n_steps=None).setup(None, _constructed_model(), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"log_every_n_steps": 0}, "log_every_n_steps=0"), ({"heatmap_every_n_steps": 0}, "heatmap_every_n_steps=0")],
)
def test_bad_arguments_are_rejected_at_construction(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEMonitor(**kwargs)


class _RouterPerBatch(L.Callback):
    """Gives the routers different weights every micro-batch (lr 0 keeps them) and keeps each
    micro-batch's per-layer aux losses, in order."""

    def __init__(self) -> None:
        self.z_loss_L1: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        g = torch.Generator().manual_seed(idx)
        for _, layer in find_moe_layers(pl_module):
            layer.router.weight.data.copy_(torch.randn(layer.router.weight.shape, generator=g) * (idx + 1))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.z_loss_L1.append(float(find_moe_layers(pl_module)[1][1].last_aux_losses["z_loss"]))


def test_aux_loss_means_restart_after_every_log(tmp_path: Path) -> None:
    spy = _RouterPerBatch()
    monitor = MoEMonitor(log_every_n_steps=1, heatmap_every_n_steps=None)
    trainer = tiny_trainer(tmp_path, [spy, monitor], max_steps=2, accumulate_grad_batches=2, log_every_n_steps=1)
    trainer.fit(_constructed_model(), train_dataloaders=token_loader())
    assert len(spy.z_loss_L1) == 4 and len(set(spy.z_loss_L1)) == 4  # 2 steps x 2 micro-batches, all different
    # The last log (step 2) averages step 2's micro-batches only, not step 1's as well.
    expected = sum(spy.z_loss_L1[2:]) / 2
    assert monitor.last_values[f"moe/z_loss/{L1}"] == pytest.approx(expected, rel=1e-5)
