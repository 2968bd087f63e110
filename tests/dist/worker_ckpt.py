"""Worker: resume from a DCP checkpoint with the identical loss tail, then reshard on load.

``python worker_ckpt.py OUT_DIR LAYOUT...`` on 4 ranks (or ``run(OUT_DIR, LAYOUT)`` from
``worker_suite.py``), ``LAYOUT`` like ``tp=2,ep=4`` (TP2·DP2 with EP4) or ``ep=2`` (EP2·EDP2):

1. continuous run at LAYOUT, AdamW with warm-up/cosine schedule, gradient accumulation 2 and
   clipping, 4 optimizer steps; ``ModelCheckpoint`` writes a DCP folder after optimizer steps 2
   and 4 (``on_train_batch_end``, as a preemption-safe run does);
2. resumed run: a fresh model and Trainer at LAYOUT continue from the step-2 folder to step 4;
   every micro-batch loss and the final parameters must be *bitwise* those of the continuous run
   (AdamW moments and step counts, the LR schedule and the loop counters all come back);
3. reshard on load: the step-4 folder is loaded at TP1 with each other EP of {4, 2, 1}
   (``validate``) and must give the continuous run's parameters exactly; every expert id is
   stored in the folder.

Why the checkpoint sits at an epoch end: accumulated gradients are not part of a Lightning
checkpoint, so a resume point must be an optimizer-step boundary; and a plain ``DataLoader`` is
not resumable, so Lightning restarts an interrupted epoch's data from its first batch (it warns).
``limit_train_batches = 2 * ACCUM`` makes every second optimizer step the end of an epoch. A
resumable loader (``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``)
lifts the second condition; it is Lightning's business, not the strategy's.

Rank 0 writes ``OUT_DIR/ckpt_<LAYOUT>.pt`` with every rank's losses of both runs.

``run_etp(OUT_DIR)`` (part ``ckpt:etp``): a DCP folder saved at tp2·ep2·etp2 loads at tp2·ep2·etp1,
tp1·ep4·etp1 and tp1·ep2·etp1 (EDP2) with bitwise the parameters it was saved with (``w13`` is
stored as gate/up halves, so a DCP reshard over F stays right) and, at the same dense layout (tp,
so the same samples per rank), bitwise the same validation loss; rank 0 writes
``OUT_DIR/ckpt_etp.pt`` (the saved parameters, the folder) for a one-process load. The same for
one file (``save_distributed_checkpoint=False``: ``w13`` stored as ``[gate | up]``), into
``OUT_DIR/ckpt_etp_file.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import ACCUM, CLIP, RecordingLM, TokenData, leave_together
from lightning_moe.lit import MoELanguageModel
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.parallel.checkpoint import gather_full_state, stored_expert_ids
from lightning_moe.strategies import FoldedMoEStrategy

STEPS, RESUME_AT = 4, 2


class AdamLM(RecordingLM):
    """The recording model with MoELanguageModel's AdamW + warm-up/cosine schedule (stateful)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_config = OptimizerConfig(learning_rate=1e-2, warmup_steps=1)

    def configure_optimizers(self) -> Any:
        return MoELanguageModel.configure_optimizers(self)


def _trainer(
    tp: int, ep: int, callbacks: list[pl.Callback] | None = None, etp: int = 1, one_file: bool = False
) -> pl.Trainer:
    strategy = FoldedMoEStrategy(tp=tp, ep=ep, etp=etp, save_distributed_checkpoint=not one_file,
                                 timeout=timedelta(seconds=90))  # fmt: skip
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy,
        max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, logger=False,
        callbacks=callbacks or [], enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, limit_train_batches=RESUME_AT * ACCUM, limit_val_batches=1,
        num_sanity_val_steps=0,
    )  # fmt: skip


def _fresh() -> AdamLM:
    torch.manual_seed(0)
    return AdamLM()


def run(out: Path, spec: str) -> None:
    degrees = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
    tp, ep = degrees.get("tp", 1), degrees.get("ep", 1)
    ckpt_dir = out / f"ckpt_{spec}"
    saver = ModelCheckpoint(
        dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
        every_n_train_steps=RESUME_AT, save_top_k=-1,
    )  # fmt: skip
    cont = _fresh()
    _trainer(tp, ep, [saver]).fit(cont)
    rank = dist.get_rank()  # the first fit initialised the process group
    final = gather_full_state(cont)
    resumed = _fresh()
    _trainer(tp, ep).fit(resumed, ckpt_path=ckpt_dir / f"step{RESUME_AT}.ckpt")
    resumed_state = gather_full_state(resumed)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (cont.recorded, resumed.recorded))
    if rank == 0:
        torch.save({"losses": losses}, out / f"ckpt_{spec}.pt")
    tail = cont.recorded[RESUME_AT * ACCUM :]
    if resumed.recorded != tail:
        raise AssertionError(f"rank {rank}: resumed losses {resumed.recorded} != continuous tail {tail}")
    for name, want in final.items():
        if not torch.equal(resumed_state[name], want):
            raise AssertionError(f"rank {rank}: {name} differs between the resumed and the continuous run")
    # reshard on load at TP1 and every other EP; zeros first so the load, not the init, decides
    last = ckpt_dir / f"step{STEPS}.ckpt"
    val = DataLoader(TokenData(), batch_size=2)
    for other_ep in (e for e in (4, 2, 1) if (1, e) != (tp, ep)):
        other = _fresh()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        _trainer(1, other_ep).validate(other, dataloaders=val, ckpt_path=last, verbose=False)
        got = gather_full_state(other)
        for name, want in final.items():
            if not torch.equal(got[name], want):
                raise AssertionError(f"rank {rank}: {name} differs after loading {spec} at tp=1,ep={other_ep}")
    if rank == 0:
        for layer in (1, 2):
            for w in ("w13", "w2"):
                key = f"state_dict.model.layers.{layer}.ffn.experts.{w}"
                ids = stored_expert_ids(last, f"{key}.gate" if w == "w13" else key)
                if ids != list(range(8)):
                    raise AssertionError(f"layer {layer} {w}: stored expert ids {ids}")
        print(f"CKPT OK {spec}", flush=True)


def run_etp(out: Path) -> None:
    """The folder, then one file (``save_distributed_checkpoint=False``), saved at tp2·ep2·etp2."""
    results = {kind: _saved_at_etp2_loads_everywhere(out, one_file=kind == "file") for kind in ("folder", "file")}
    if dist.get_rank() == 0:
        torch.save(results["folder"], out / "ckpt_etp.pt")
        torch.save(results["file"], out / "ckpt_etp_file.pt")
        print(f"CKPT OK etp {results['folder']['losses']} file {results['file']['losses']}", flush=True)


def _saved_at_etp2_loads_everywhere(out: Path, one_file: bool) -> dict[str, Any]:
    ckpt_dir = out / ("ckpt_etp_file" if one_file else "ckpt_etp")
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="saved", every_n_train_steps=RESUME_AT, save_top_k=1)
    saved_model = _fresh()
    _trainer(2, 2, [saver], etp=2, one_file=one_file).fit(saved_model)
    saved = gather_full_state(saved_model)
    path = ckpt_dir / "saved.ckpt"
    if path.is_file() != one_file:
        raise AssertionError(f"{path}: expected {'one file' if one_file else 'a folder'}")
    val = DataLoader(TokenData(), batch_size=2)
    rank, losses = dist.get_rank(), {}
    for tp, ep, etp in ((2, 2, 2), (2, 2, 1), (1, 4, 1), (1, 2, 1)):
        other = _fresh()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        metrics = _trainer(tp, ep, etp=etp).validate(other, dataloaders=val, ckpt_path=path, verbose=False)
        losses[(tp, ep, etp)] = metrics[0]["val/loss"] if metrics and "val/loss" in metrics[0] else None
        got = gather_full_state(other)
        for name, want in saved.items():
            if not torch.equal(got[name], want):
                diff = (got[name] - want).abs().max().item()
                raise AssertionError(f"rank {rank}: {name} differs by {diff} after loading {path.name} saved at "
                                     f"tp2·ep2·etp2 at tp{tp}·ep{ep}·etp{etp}")  # fmt: skip
    # the same dense layout (tp, hence dp: which samples each rank reads) gives the same loss bit for bit
    if None in losses.values() or losses[(2, 2, 2)] != losses[(2, 2, 1)] or losses[(1, 4, 1)] != losses[(1, 2, 1)]:
        raise AssertionError(f"rank {rank}: validation losses differ across layouts ({path.name}): {losses}")
    return {"params": saved, "folder": str(path), "losses": losses}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for layout in sys.argv[2:]:
        run(Path(sys.argv[1]), layout)
    leave_together()
