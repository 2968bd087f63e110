"""Worker: Trainer.fit of a swapped Hugging Face Qwen3-MoE with FoldedMoEStrategy at pp > 1.

``python worker_pipeline_hf_fit.py OUT_DIR SPEC...``; a spec is ``pp=2,ep=2,schedule=1f1b,n=4``
(``_pipeline_models.parse``; ``packed=1``: packed-document data). Each trains ``STEPS`` optimizer
steps with gradient accumulation 2 and clipping, fp32, then validates through the pipeline. Rank 0 writes ``OUT_DIR/<spec>.pt``: every
rank's (dp coordinate, logged batch losses), the logged ``train/loss``, the validation loss and the
final parameters of every stage under the HF model's names, and every rank's ``trainer.predict``
output after the fit (sample indices and logits; under CP the refusal's message). A spec ending in ``,meta`` builds the
model on ``meta`` instead and trains one step (:func:`fit_meta`).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import CLIP, leave_together
from _pipeline_hf_models import HFRecordingLM, model_names
from _pipeline_models import accumulation, make_data, packed, parse
from lightning_moe.strategies import FoldedMoEStrategy

STEPS = 3
PREDICT_DATA = (6, 11)  # predicted samples and seed


class PredictingHFLM(HFRecordingLM):
    """Predictions name their samples: ``{"index", "logits"}`` per batch."""

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"index": batch["index"], "logits": super().predict_step(batch, batch_idx)}


def predict(trainer: pl.Trainer, model: HFRecordingLM, spec: str) -> object:
    """``trainer.predict`` of ``PREDICT_DATA`` in batches of 4 (the last shorter than the micro-batch
    count): this rank's ``(indices, logits)``; under CP the refusal's message instead."""
    data = make_data(packed(spec), num_samples=PREDICT_DATA[0], seed=PREDICT_DATA[1])
    samples = [{**data[i], "index": torch.tensor(i)} for i in range(len(data))]
    try:
        outputs = trainer.predict(model, dataloaders=torch.utils.data.DataLoader(samples, batch_size=4))
    except ValueError as error:
        return str(error)
    return torch.cat([o["index"] for o in outputs]).tolist(), torch.cat([o["logits"] for o in outputs])


def fit_one(spec: str, out_dir: Path, world: int) -> None:
    if spec.endswith(",meta"):
        return fit_meta(spec.removesuffix(",meta"), out_dir, world)
    torch.manual_seed(0)
    model = PredictingHFLM(packed=packed(spec))
    strategy = FoldedMoEStrategy(**parse(spec), timeout=timedelta(seconds=90))
    accum = accumulation(spec)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=accum,
        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1.0, val_check_interval=STEPS * accum,
    )  # fmt: skip
    trainer.fit(model)
    state = model_names(model.model)
    states = [None] * world
    dist.all_gather_object(states, state)
    merged = {k: v for s in states for k, v in s.items()}
    losses = [None] * world
    dist.all_gather_object(losses, (strategy.folded_mesh.rank("dp"), model.recorded))
    logged = float(trainer.callback_metrics["train/loss"])
    val = float(trainer.callback_metrics["val/loss"]) if "val/loss" in trainer.callback_metrics else None
    predictions = [None] * world
    dist.all_gather_object(predictions, predict(trainer, model, spec))
    if dist.get_rank() == 0:
        result = {"losses": losses, "state": merged, "logged_loss": logged, "val_loss": val}
        result |= {"predictions": predictions, "predict_data": PREDICT_DATA}
        torch.save(result, out_dir / f"{spec}.pt")
        print(f"DONE {spec}", flush=True)


def fit_meta(spec: str, out_dir: Path, world: int) -> None:
    """The model built on ``meta`` (``init_module(empty_init=True)``), one optimizer step: every rank's
    rotary frequencies as a fresh model's, and the loss."""
    strategy = FoldedMoEStrategy(**parse(spec), timeout=timedelta(seconds=90))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = HFRecordingLM()
    trainer.fit(model)
    fresh = HFRecordingLM().model.model.rotary_emb.inv_freq
    same = torch.equal(model.model.rotary_emb.inv_freq, fresh)
    rows = [None] * world
    dist.all_gather_object(rows, (same, model.recorded))
    if dist.get_rank() == 0:
        torch.save({"ranks": rows}, out_dir / f"{spec},meta.pt")
        print(f"DONE {spec},meta", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)  # a seed left by an earlier test would change the sampler's order
    out = Path(sys.argv[1])
    world = int(os.environ["WORLD_SIZE"])
    for spec in sys.argv[2:]:
        fit_one(spec, out, world)
    leave_together()
