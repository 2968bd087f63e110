"""Worker: the whole fold (context parallel, sequence parallel, vocab-parallel head, packed rows)
under the Trainer and under Fabric, one torchrun job for all parts of a world size.

``python worker_fold.py OUT_DIR PART...`` on W gloo ranks; each part ends with a barrier and rank
0 prints ``PART OK <part> <seconds>s`` (``_harness.Suite.check`` reads it). Parts:

* ``trainer:<layout>`` — ``Trainer.fit`` with ``FoldedMoEStrategy``; ``fabric:<layout>`` — a Fabric
  loop with ``FabricFoldedMoEStrategy`` (``strategy.shard_batch``, ``lm_token_mean_loss`` over
  ``strategy.loss_group``, ``no_backward_sync``, ``clip_gradients``). Both train ``STEPS`` SGD steps
  with gradient accumulation 2 and clipping, fp32. A layout is ``tp=2,cp=2,ep=4`` with the flags
  ``sp=1`` (sequence_parallel), ``vp=1`` (vocab_parallel), ``packed=1`` (:class:`PackedTokens`
  rows: documents, restarting positions, ``-100`` labels at boundaries and padding) and ``bias=1``
  (the routers' aux-loss-free expert bias, stepped from counts over ``expert_bias_group``). Rank 0 writes
  ``OUT_DIR/<part>.pt``: every rank's (DP coordinate, per-micro-batch losses), the final full
  parameters and the logged ``train/loss`` (the mean over all ranks). A rank's recorded loss is
  its loss averaged over its CP group: the DP replica's share of the step's token mean, what
  :func:`fold_reference` / ``_models.reference`` compute for that DP shard.
* ``ckpt`` — DCP checkpoints stay layout-independent: 2 steps at tp2·cp2 (SP on) with EP4, the
  folder loaded at tp1·cp1 (EP2) and saved there, that folder loaded back at tp2·cp2 (SP on):
  bitwise the parameters each time, and the validation loss at both layouts equal (1e-6).
* ``bad`` — at cp2 a batch of length 6 raises the length error (naming 6 and the multiple 4) at
  the first batch on every rank, and a model holding attention that context parallel cannot wrap
  is refused when the strategy shards it, naming the module; rank 0 writes ``OUT_DIR/bad.pt``
  with both messages. No rank hangs: the part ends with the job's barrier.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import (
    ACCUM, BATCH, CLIP, LR, NUM_SAMPLES, SEQ, STEPS, VOCAB, RecordingLM, TokenData, leave_together, model_config,
)  # fmt: skip
from lightning_moe.data.packing import PackedDataset
from lightning_moe.lit import MoELanguageModelBase
from lightning_moe.moe.utils import set_aux_loss_scale, update_expert_biases
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.parallel.fold_batch import lm_token_mean_loss
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy

EOS = 0
_FLAGS = {"sp": "sequence_parallel", "vp": "vocab_parallel"}


class PackedTokens(Dataset):
    """``NUM_SAMPLES`` packed rows of ``SEQ`` tokens: random documents of 1..11 tokens (ids 1..VOCAB-1),
    each closed by ``EOS``, laid end to end by ``PackedDataset`` (long ones split), the same on every rank."""

    def __init__(self, seed: int = 2000) -> None:
        g = torch.Generator().manual_seed(seed)
        docs = []
        for _ in range(NUM_SAMPLES * 2):
            n = int(torch.randint(1, 12, (), generator=g))
            docs.append(torch.cat([torch.randint(1, VOCAB, (n,), generator=g), torch.tensor([EOS])]))
        self.rows = PackedDataset(torch.cat(docs), SEQ, EOS)
        if len(self.rows) < NUM_SAMPLES:
            raise AssertionError(f"PackedTokens: {len(self.rows)} rows < {NUM_SAMPLES}")

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def parse(spec: str) -> tuple[dict[str, Any], dict[str, bool]]:
    """Strategy keywords of a layout, and its model/data flags (``packed``, ``bias``)."""
    kwargs: dict[str, Any] = {}
    flags = {"packed": False, "bias": False}
    for item in spec.split(","):
        k, v = item.split("=")
        if k in flags:
            flags[k] = v == "1"
        elif k in _FLAGS:
            kwargs[_FLAGS[k]] = v == "1"
        else:
            kwargs[k] = int(v)
    return kwargs, flags


def dp_size(spec: str, world: int) -> int:
    kwargs, _ = parse(spec)
    return world // (kwargs.get("tp", 1) * kwargs.get("cp", 1))


def _cp_mean(loss: torch.Tensor, strategy: Any) -> float:
    """This rank's loss averaged over its CP group (the DP replica's share of the step's mean)."""
    cp = strategy.context_parallel
    value = loss.detach().clone().float()
    if cp.group is not None:
        dist.all_reduce(value, group=cp.group)
        value /= cp.size
    return float(value)


class FoldLM(RecordingLM):
    """The recording model; records the CP-group mean of each micro-batch loss; packed rows on request."""

    packed = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = MoELanguageModelBase.training_step(self, batch, batch_idx)
        self.recorded.append(_cp_mean(loss, self.trainer.strategy))
        return loss

    def train_data(self) -> Dataset:
        return PackedTokens() if self.packed else TokenData()


def _model(packed: bool = False, bias: bool = False) -> FoldLM:
    config = model_config()
    if bias:
        config.moe = dataclasses.replace(config.moe, expert_bias=True, bias_update_rate=1e-2)
    torch.manual_seed(0)
    lm = FoldLM(config)
    lm.packed = packed
    return lm


def run_trainer(out: Path, part: str, spec: str) -> None:
    kwargs, flags = parse(spec)
    world = dist.get_world_size()
    model = _model(**flags)
    strategy = FoldedMoEStrategy(**kwargs, timeout=timedelta(seconds=90))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    state = {name: value.cpu() for name, value in gather_full_state(model).items()}
    losses = [None] * world
    dist.all_gather_object(losses, (strategy.folded_mesh.rank("dp"), model.recorded))
    logged = float(trainer.callback_metrics["train/loss"])
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": state, "logged_loss": logged}, out / f"{part}.pt")


def run_fabric(out: Path, part: str, spec: str) -> None:
    kwargs, flags = parse(spec)
    world = dist.get_world_size()
    strategy = FabricFoldedMoEStrategy(**kwargs, timeout=timedelta(seconds=90))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    lm = _model(**flags)
    model = fabric.setup(lm.model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(lm.train_data(), batch_size=BATCH, shuffle=True))
    set_aux_loss_scale(model, 1.0 / ACCUM)
    group, ranks = strategy.loss_group
    batches = iter(loader)
    losses: list[float] = []
    last = torch.zeros(())
    for _ in range(STEPS):
        for micro in range(ACCUM):
            batch = strategy.shard_batch(next(batches))
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
                loss = lm_token_mean_loss(model, logits, batch["labels"], group, ranks)
                fabric.backward(loss / ACCUM)
            losses.append(_cp_mean(loss, strategy))
            last = loss.detach().clone()
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        update_expert_biases(model, strategy.expert_bias_group)
    dist.all_reduce(last)
    state = {f"model.{k}": v for k, v in gather_full_state(model.module).items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, (strategy.folded_mesh.rank("dp"), losses))
    if fabric.global_rank == 0:
        torch.save({"losses": gathered, "state": state, "logged_loss": float(last) / world}, out / f"{part}.pt")


# ---- checkpoints across layouts ------------------------------------------------------------------


def _ckpt_trainer(degrees: dict[str, Any], callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    strategy = FoldedMoEStrategy(**degrees, timeout=timedelta(seconds=90))
    return pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=2, accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP, logger=False, callbacks=callbacks or [], enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=4, num_sanity_val_steps=0,
    )  # fmt: skip


def _zeroed() -> FoldLM:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _expect_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    rank = dist.get_rank()
    if set(got) != set(want):
        raise AssertionError(f"rank {rank}: {what}: names differ: {sorted(set(got) ^ set(want))}")
    for name, value in want.items():
        if not torch.equal(got[name], value):
            raise AssertionError(f"rank {rank}: {what}: {name} differs by {(got[name] - value).abs().max().item()}")


def run_ckpt(out: Path) -> None:
    folded = {"tp": 2, "cp": 2, "ep": 4, "sequence_parallel": True}
    plain = {"tp": 1, "cp": 1, "ep": 2}
    val = DataLoader(TokenData(num_samples=8), batch_size=2)
    saver = ModelCheckpoint(dirpath=out / "ckpt_fold", filename="folded", every_n_train_steps=2, save_top_k=1)
    trained = _model()
    _ckpt_trainer(folded, [saver]).fit(trained)
    saved = gather_full_state(trained)
    folder = out / "ckpt_fold" / "folded.ckpt"
    losses = {}
    at_plain = _zeroed()
    trainer = _ckpt_trainer(plain)
    losses["plain"] = trainer.validate(at_plain, dataloaders=val, ckpt_path=folder, verbose=False)[0]["val/loss"]
    _expect_equal(gather_full_state(at_plain), saved, "saved at tp2·cp2·sp, loaded at tp1·cp1")
    back_folder = out / "ckpt_fold" / "plain.ckpt"
    trainer.save_checkpoint(back_folder, weights_only=True)
    back = _zeroed()
    losses["folded"] = _ckpt_trainer(folded).validate(back, dataloaders=val, ckpt_path=back_folder, verbose=False)[0][
        "val/loss"
    ]
    _expect_equal(gather_full_state(back), saved, "saved at tp1·cp1, loaded at tp2·cp2·sp")
    if abs(losses["plain"] - losses["folded"]) > 1e-6 * abs(losses["plain"]):
        raise AssertionError(f"validation losses differ between layouts: {losses}")
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "params": saved}, out / "ckpt.pt")


# ---- bad input under context parallel ----------------------------------------------------------


class _ShortRows(FoldLM):
    def train_data(self) -> Dataset:
        return TokenData(seq=6)


class _ExtraMHA(FoldLM):
    def __init__(self) -> None:
        super().__init__()
        self.model.layers[0].extra = torch.nn.MultiheadAttention(32, 2, batch_first=True)


def _fit_error(model: FoldLM, expected: type[Exception]) -> str:
    strategy = FoldedMoEStrategy(cp=2, ep=2, timeout=timedelta(seconds=60))
    trainer = pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    try:
        trainer.fit(model)
    except expected as err:
        return str(err)
    raise AssertionError(f"rank {dist.get_rank()}: {type(model).__name__} trained at cp=2 without {expected.__name__}")


def run_bad(out: Path) -> None:
    messages = {
        "length": _fit_error(_ShortRows(), ValueError),
        "attention": _fit_error(_ExtraMHA(), TypeError),
    }
    if dist.get_rank() == 0:
        torch.save(messages, out / "bad.pt")


# ---- the one-process reference of packed rows ----------------------------------------------------


@functools.lru_cache(maxsize=None)
def fold_reference(dp: int, packed: bool = False, bias: bool = False) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, exactly what the layouts compute: each DP shard is a micro-batch of its own
    (per-rank router statistics), its loss the sum over its labelled tokens divided by the
    labelled tokens of all DP shards of that micro-batch (times ``dp``, the value a rank records);
    the aux losses scaled by ``1/(dp*ACCUM)``; with ``bias`` the expert biases stepped after each
    optimizer step from the counts of every shard. Returns ``losses[micro][dp_rank]`` and the
    final parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = _model(packed, bias)
        model = lm.model
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        data = PackedTokens() if packed else TokenData()
        orders = [list(DistributedSampler(data, num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
        set_aux_loss_scale(model, 1.0 / (dp * ACCUM))
        losses: list[list[float]] = []
        for step in range(STEPS):
            for micro in range(ACCUM):
                b = step * ACCUM + micro
                shards = [
                    torch.utils.data.default_collate([data[i] for i in orders[d][b * BATCH : (b + 1) * BATCH]])
                    for d in range(dp)
                ]
                count = sum(int((s["labels"] != -100).sum()) for s in shards)
                row = []
                for batch in shards:
                    logits = lm(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
                    loss_sum = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
                    )
                    share = loss_sum * dp / count
                    (share / (dp * ACCUM)).backward()
                    row.append(float(share.detach()))
                losses.append(row)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            update_expert_biases(model)
        return losses, {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def run_part(part: str, out: Path) -> None:
    kind, _, spec = part.partition(":")
    if kind == "trainer":
        run_trainer(out, part, spec)
    elif kind == "fabric":
        run_fabric(out, part, spec)
    elif kind == "ckpt":
        run_ckpt(out)
    elif kind == "bad":
        run_bad(out)
    else:
        raise ValueError(f"worker_fold: part={part!r} is not known; use trainer:<layout>, fabric:<layout>, ckpt or bad.")


def main(out: Path, parts: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("SUITE_PG_TIMEOUT", "120"))))
    for part in parts:
        start = time.perf_counter()
        run_part(part, out)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"PART OK {part} {time.perf_counter() - start:.1f}s", flush=True)
    leave_together()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
