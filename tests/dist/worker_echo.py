"""Worker: ECHO expert cloning under FoldedMoEStrategy(ep=4), three fits in one torchrun job.

``python worker_echo.py OUT_DIR`` on 4 gloo ranks. The routers carry an expert bias that makes
every token pick expert 0 (home: EP rank 0) plus one other expert, so EP rank 0 processes
about 8/7 of the mean load times 2 (max/mean ~ 2.3).

1. ``plain``: 5 optimizer steps (accumulation 2) with MoEMonitor, no cloning;
2. ``echo``: the same with ECHOExpertCloning(spare_slots_per_rank=2, interval=1); a DCP
   checkpoint is saved after optimizer step 3, while clones are active;
3. ``resumed``: a fresh model and Trainer *without* ECHO resume from that checkpoint to step 5.

Rank 0 writes ``OUT_DIR/echo.pt``: every rank's losses, the monitor's EP load ratio after every
step, the clone counts, and the final full parameters of each run.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import lightning_moe  # noqa: F401 - registers "folded_moe"
import _models  # noqa: E402 - tests/dist is on sys.path for workers
from lightning_moe.callbacks import ECHOExpertCloning, MoEMonitor
from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.moe.utils import find_moe_layers
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FoldedMoEStrategy

VOCAB, SEQ, BATCH, ACCUM, STEPS, LR = 64, 16, 2, 2, 5, 0.3
CKPT_STEP = 3
NUM_SAMPLES = 4 * BATCH * ACCUM * CKPT_STEP  # epoch 0 ends with the checkpoint (exact resume)
EP_LOAD = "moe/ep_load_max_over_mean"


def token_data() -> Dataset:
    return _models.TokenData(num_samples=NUM_SAMPLES, seq=SEQ, seed=2000, vocab=VOCAB)


class BiasedLM(_models.RecordingLM):
    """Two MoE blocks, 8 experts, top-2; expert 0 always chosen (bias 1.0, frozen). SGD."""

    def __init__(self) -> None:
        moe = MoEConfig(
            hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, pre_softmax=True,
            expert_bias=True, bias_update_rate=0.0, aux_loss="switch", aux_loss_coeff=0.01,
        )  # fmt: skip
        cfg = TransformerConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, moe=moe, max_seq_len=SEQ)
        super().__init__(cfg, lr=LR)
        for _, layer in find_moe_layers(self):
            layer.router.expert_bias[0] = 1.0

    def train_data(self) -> Dataset:
        return token_data()


class Probe(pl.Callback):
    """After each optimizer step: the monitor's EP load ratio and ECHO's clone count; saves a
    checkpoint after step ``CKPT_STEP`` when given a path."""

    def __init__(self, monitor: MoEMonitor, echo: ECHOExpertCloning | None, ckpt: Path | None) -> None:
        self.monitor, self.echo, self.ckpt = monitor, echo, ckpt
        self.ep_load: list[float] = []
        self.clones: list[int] = []
        self._last = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._last = trainer.global_step  # 3 when resumed

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.ep_load.append(self.monitor.last_values[EP_LOAD])
            self.clones.append(sum(self.echo.active_clones) if self.echo else 0)
            if self.ckpt is not None and trainer.global_step == CKPT_STEP:
                trainer.save_checkpoint(self.ckpt)  # at a step boundary, clones active


def fit(kind: str, ckpt: Path, dispatcher: str = "alltoall") -> dict[str, Any]:
    torch.manual_seed(0)
    model = BiasedLM()
    monitor = MoEMonitor(heatmap_every_n_steps=None, per_layer=False)
    echo = ECHOExpertCloning(spare_slots_per_rank=2, interval=1) if kind == "echo" else None
    probe = Probe(monitor, echo, ckpt if kind == "echo" else None)
    callbacks: list[Any] = [monitor, probe] if echo is None else [echo, monitor, probe]
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        strategy=FoldedMoEStrategy(ep=4, dispatcher=dispatcher, timeout=timedelta(seconds=90)), max_steps=STEPS,
        accumulate_grad_batches=ACCUM, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    # The checkpoint's hyper-parameters hold config dataclasses; Lightning 2.6.6 drops fit's
    # weights_only for strategies that restore after setup, so allow-list them for torch.load.
    with torch.serialization.safe_globals([TransformerConfig, MoEConfig]):
        trainer.fit(model, ckpt_path=str(ckpt) if kind == "resumed" else None)
    dispatchers = {type(layer.dispatcher).__name__ for _, layer in find_moe_layers(model)}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (model.recorded, probe.ep_load, probe.clones))
    state = gather_full_state(model)
    return {"per_rank": per_rank, "state": state, "dispatchers": sorted(dispatchers)}


def run(out: Path, dispatcher: str = "") -> None:
    """The three fits; rank 0 writes ``out/echo.pt`` (the ``echo`` part of ``worker_suite.py``).

    ``dispatcher`` (the ``echo:<dispatcher>`` part): plain and ECHO fits only, over that dispatcher,
    into ``out/echo_<dispatcher>.pt``.
    """
    ckpt = out / f"ckpt_step3{dispatcher}"
    results = {}
    for kind in ("plain", "echo") if dispatcher else ("plain", "echo", "resumed"):
        start = time.perf_counter()
        results[kind] = fit(kind, ckpt, dispatcher or "alltoall")
        if dist.get_rank() == 0:
            print(f"{kind}: {time.perf_counter() - start:.1f} s", flush=True)
    if dist.get_rank() == 0:
        torch.save(results, out / (f"echo_{dispatcher}.pt" if dispatcher else "echo.pt"))
        print("DONE echo", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(Path(sys.argv[1]))
    _models.leave_together()
