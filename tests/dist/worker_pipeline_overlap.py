"""Worker: Fabric with PP2 x EP2 and the "V" schedule dualpipev, expert all-to-all overlap off and on.

``python worker_pipeline_overlap.py OUT_DIR RUN...``; a run is ``<dispatcher>[-<variant>]-<off|on>``
(``alltoall_dedup-on``: ``FabricFoldedMoEStrategy(dispatcher="alltoall_dedup",
pp_overlap_expert_comm=True)`` at W=4). A variant changes the model or the layout
(:data:`VARIANTS`): ``recompute_moe`` and ``recompute_block`` (``TransformerConfig.recompute``: the
MoE layer, or the whole block, run again in the backward, its dispatch and combine all-to-alls
included), ``fp8`` (FP8 experts, emulated, with FP8 rows through the dispatch all-to-all, and FP8
dense layers), ``sp_etp`` (W=8: ``tp=2`` with sequence parallel and ``etp=2``, so the TP and
expert-TP all-gathers and reduce-scatters run between the all-to-alls). Each run trains
``STEPS`` SGD steps of the 4-block model of ``_models`` (1 dense, 3 MoE; 4 stages of one block, 2
per rank) from the same seed on the same batches, 4 micro-batches per batch, and records what each
rank did during its training steps, in order:

* ``("issue", thread, async)``: an all-to-all issued (``torch.distributed.all_to_all_single``,
  ``async``: with ``async_op=True``); ``("wait", thread)``: this thread waited for it (returned
  from the call, for a synchronous one);
* ``("compute", thread)``: autograd saved a tensor (forward) or used one (backward), recorded by
  ``torch.autograd.graph.saved_tensors_hooks`` around each step;
* ``("pair", "begin" | "end")``: ``CommTurns.run_pair`` started and returned (an overlapped
  forward+backward action).

``thread`` is the thread's name: the forward runs on ``MainThread``, the backward of an overlapped
action on its helper thread. Rank 0 writes ``OUT_DIR/<run>.pt``: every rank's batch losses, pp
coordinate and events, and the final full parameters.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import LR, RecordingLM, TokenData, leave_together, model_config
from lightning_moe.config import Fp8Config
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.moe.dispatch.turns import CommTurns
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.strategies import FabricFoldedMoEStrategy

STEPS, BATCH, MICRO = 2, 4, 4


def _fp8(cfg: TransformerConfig) -> TransformerConfig:
    fp8 = Fp8Config(recipe="blockwise", backend="emulate", dispatch=True)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, fp8=fp8), fp8_dense="on")


def _recompute(target: str) -> Callable[[TransformerConfig], TransformerConfig]:
    return lambda cfg: dataclasses.replace(cfg, recompute=[target])


# a run's variant -> (the change to the model's config, the strategy's options beyond PP2 x EP2)
VARIANTS: dict[str, tuple[Callable[[TransformerConfig], TransformerConfig], dict[str, Any]]] = {
    "": (lambda cfg: cfg, {}),
    "recompute_moe": (_recompute("moe"), {}),
    "recompute_block": (_recompute("block"), {}),
    "fp8": (_fp8, {}),
    "sp_etp": (lambda cfg: cfg, {"tp": 2, "etp": 2, "sequence_parallel": True}),
}


class Recorder:
    """The events of one rank while ``active`` (module docstring)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.active = False
        self._lock = threading.Lock()

    def add(self, *event: Any) -> None:
        if self.active:
            with self._lock:
                self.events.append(event)

    def compute(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add("compute", threading.current_thread().name)
        return tensor


class _RecordedWork:
    """An async all-to-all's work whose ``wait`` is recorded."""

    def __init__(self, work: Any, recorder: Recorder) -> None:
        self._work, self._recorder = work, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._recorder.add("wait", threading.current_thread().name)
        return result


def install(recorder: Recorder) -> None:
    """Record every all-to-all and every overlapped pair (module docstring)."""
    all_to_all = dist.all_to_all_single
    run_pair = CommTurns.run_pair

    def recorded_all_to_all(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        recorder.add("issue", name, async_op)
        work = all_to_all(*args, async_op=async_op, **kwargs)
        if async_op:
            return _RecordedWork(work, recorder)
        recorder.add("wait", name)
        return work

    def recorded_pair(self: CommTurns, *args: Any, **kwargs: Any) -> None:
        recorder.add("pair", "begin")
        try:
            run_pair(self, *args, **kwargs)
        finally:
            recorder.add("pair", "end")

    dist.all_to_all_single = recorded_all_to_all  # type: ignore[assignment]
    CommTurns.run_pair = recorded_pair  # type: ignore[method-assign]


def run(out: Path, name: str, world: int, recorder: Recorder) -> None:
    dispatcher, *variant, mode = name.split("-")
    change, options = VARIANTS["".join(variant)]
    strategy = FabricFoldedMoEStrategy(
        pp=2, ep=2, pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=MICRO, dispatcher=dispatcher,
        pp_overlap_expert_comm=mode == "on", timeout=timedelta(seconds=90), **options,
    )  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(RecordingLM(change(model_config(num_layers=4))).model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(TokenData(num_samples=STEPS * BATCH * 2), batch_size=BATCH))
    batches, losses = iter(loader), []
    recorder.events.clear()
    for _ in range(STEPS):
        recorder.active = True
        with torch.autograd.graph.saved_tensors_hooks(recorder.compute, recorder.compute):
            loss = strategy.pipeline_step(next(batches), 1)
        recorder.active = False
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v for k, v in gather_full_state(strategy.pipeline.stages).items()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (strategy.folded_mesh.rank("pp"), losses, list(recorder.events), state))
    if dist.get_rank() == 0:
        merged = {k: v for _, _, _, s in everyone for k, v in s.items()}
        ranks = [{"pp": pp, "losses": l, "events": e} for pp, l, e, _ in everyone]
        torch.save({"ranks": ranks, "state": merged}, out / f"{name}.pt")
        print(f"DONE {name}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)
    events = Recorder()
    install(events)
    out_dir = Path(sys.argv[1])
    for run_name in sys.argv[2:]:
        run(out_dir, run_name, int(os.environ["WORLD_SIZE"]), events)
    leave_together()
