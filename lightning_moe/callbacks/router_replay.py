"""RouterReplay: record every MoE layer's top-k expert ids, or force previously recorded ones.

Use cases: reinforcement learning where the rollout engine routed differently from the trainer
(R3, "rollout routing replay"), and reproducible debugging of routing-sensitive runs.

Stages of one training micro-batch:

1. ``on_train_batch_start``: key the micro-batch as ``(global_step, micro_batch)`` (the index of
   the micro-batch inside the optimizer step, counted from 0) and install a routing override on
   every layer's router (``router.set_routing_override``).
2. Forward: the override receives the ids the router computed. ``record`` returns them
   unchanged and keeps them; ``replay`` returns the recorded ids instead. Either way the router
   re-gathers the combine weights from its *live* scores, so it keeps receiving gradients.
3. Activation recompute (``torch.utils.checkpoint``, reentrant or not) runs the forward again
   inside backward. The override detects that (an autograd graph task is executing) and returns
   the ids of the matching original forward, so forward and recompute always route alike.
4. ``on_train_batch_end``: the override is removed (validation routes normally); ``record``
   moves this micro-batch's ids to host memory and writes a shard file every
   ``steps_per_file`` optimizer steps and at the end of training.

File format ``lightning-moe-router-replay``, version 1
------------------------------------------------------

``path`` is a directory. Every process writes and reads only its own shards, named
``rank{global_rank:05d}-step{first_step:09d}.pt`` (a process routes only its own tokens, so
there is nothing to gather). Each shard is a ``torch.save``'d dict, loadable with
``torch.load(..., weights_only=True)``::

    {
        "format": "lightning-moe-router-replay",
        "version": 1,
        "rank": int,                 # global rank that routed these tokens
        "world_size": int,
        "layers": [str, ...],        # qualified MoELayer names, in model order
        "num_experts": {layer: int},
        "top_k": {layer: int},
        "steps": {
            (global_step, micro_batch): {      # both int, micro_batch counts from 0 per step
                layer: ids_TK,                 # int16 (int32 when E > 32767) tensor [tokens, top_k]
                # or a list of such tensors: one per forward of that layer in the micro-batch
            },
        },
    }

A shard covers the steps from ``first_step`` up to the next shard's first step. An external
writer (e.g. an RL rollout engine) produces the same dict to have the trainer replay its routes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_moe.callbacks._layers import require_moe_layers
from lightning_moe.moe.layer import MoELayer

__all__ = ["FORMAT", "VERSION", "RouterReplay", "load_shard", "shard_name"]

FORMAT = "lightning-moe-router-replay"
VERSION = 1
_SHARD_RE = re.compile(r"^rank(\d{5})-step(\d{9})\.pt$")

StepKey = tuple[int, int]


def shard_name(rank: int, first_step: int) -> str:
    """File name of the shard of ``rank`` whose first optimizer step is ``first_step``."""
    return f"rank{rank:05d}-step{first_step:09d}.pt"


def load_shard(file: str | Path) -> dict[str, Any]:
    """Load one shard and check its format and version; raise naming the file otherwise."""
    data = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"RouterReplay: {file} is not a {FORMAT!r} file; point path= at a recorded directory.")
    if data.get("version") != VERSION:
        raise ValueError(
            f"RouterReplay: {file} has version={data.get('version')!r}, this reader understands version={VERSION}; "
            "record again with this lightning-moe version."
        )
    return data


class _Call:
    """One forward of one layer in the current micro-batch (kept until the micro-batch ends)."""

    __slots__ = ("computed_TK", "forced_TK", "recomputed")

    def __init__(self, computed_TK: torch.Tensor, forced_TK: torch.Tensor) -> None:
        self.computed_TK = computed_TK
        self.forced_TK = forced_TK
        self.recomputed = False


def _in_backward() -> bool:
    """True while the autograd engine executes a graph: a checkpoint recompute runs then."""
    return torch._C._current_graph_task_id() != -1


class RouterReplay(Callback):
    """Record the top-k expert ids of every MoE layer, or replay recorded ones.

    Args:
        mode: ``"record"`` writes the ids the routers compute; ``"replay"`` forces recorded ids.
        path: directory of the shard files (created by ``record``; see the module docstring).
        steps_per_file: optimizer steps per shard file (``record``); bounds host memory.
    """

    supports_pipeline_parallel = False  # acts on one forward and backward of the whole model

    def __init__(self, mode: Literal["record", "replay"], path: str, steps_per_file: int = 100) -> None:
        if mode not in ("record", "replay"):
            raise ValueError(f"RouterReplay: mode={mode!r} is unknown; choose 'record' or 'replay'.")
        if steps_per_file < 1:
            raise ValueError(f"RouterReplay: steps_per_file={steps_per_file} must be >= 1.")
        self.mode = mode
        self.path = Path(path)
        self.steps_per_file = steps_per_file
        self._layers: list[tuple[str, MoELayer]] = []
        self._rank = 0
        self._world_size = 1
        self._key: StepKey | None = None
        self._calls: dict[str, list[_Call]] = {}
        # record: host copies waiting for the next shard write
        self._pending: dict[StepKey, dict[str, torch.Tensor | list[torch.Tensor]]] = {}
        # replay: first step of every shard of this rank, and the shard loaded now
        self._shards: dict[int, Path] = {}
        self._loaded_first: int | None = None
        self._loaded: dict[str, Any] | None = None

    # --- Lightning hooks ------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._layers = require_moe_layers("RouterReplay", pl_module)
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        if self.mode == "replay" and stage == "fit":
            self._index_shards()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self._key = (step, 0) if self._key is None or self._key[0] != step else (step, self._key[1] + 1)
        self._calls = {name: [] for name, _ in self._layers}
        for name, layer in self._layers:
            layer.router.set_routing_override(self._override_for(name))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._remove_overrides()
        if self.mode == "record" and self._key is not None:
            self._keep(self._key)
            if len({s for s, _ in self._pending}) >= self.steps_per_file and trainer.global_step > self._key[0]:
                self._flush()
        self._calls = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_overrides()
        if self.mode == "record":
            self._flush()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_overrides()
        if self.mode == "record":
            self._flush()  # what was routed so far is still a valid recording

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_overrides()

    # --- the override ---------------------------------------------------------------------------

    def _override_for(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def override(computed_TK: torch.Tensor) -> torch.Tensor:
            return self._route(name, computed_TK)

        return override

    def _route(self, name: str, computed_TK: torch.Tensor) -> torch.Tensor:
        calls = self._calls.setdefault(name, [])
        if _in_backward() and calls:
            return self._recomputed(name, calls, computed_TK).forced_TK
        if self.mode == "record":
            forced_TK = computed_TK
        else:
            forced_TK = self._recorded(name, len(calls), computed_TK)
        calls.append(_Call(computed_TK.detach(), forced_TK))
        return forced_TK

    def _recomputed(self, name: str, calls: list[_Call], computed_TK: torch.Tensor) -> _Call:
        """The original forward a recompute repeats: the one whose computed ids it reproduces.

        Recompute sees the same weights and inputs as the original forward, so the router computes
        the same ids; with several forwards of one layer per micro-batch, that identifies the call
        (ties go to the latest not yet recomputed, as backward runs in reverse order).
        """
        if len(calls) == 1:
            return calls[0]
        same_shape = [c for c in calls if c.computed_TK.shape == computed_TK.shape]
        # SYNC: comparing ids (only when one layer runs several forwards per micro-batch)
        matching = [c for c in same_shape if torch.equal(c.computed_TK, computed_TK)] or same_shape
        if not matching:
            raise RuntimeError(
                f"RouterReplay: a recomputed forward of layer {name!r} at global_step={self._key[0]}, "  # type: ignore[index]
                f"micro_batch={self._key[1]} routes {tuple(computed_TK.shape)} ids, matching none of its "  # type: ignore[index]
                f"{len(calls)} original forwards; recompute must see the inputs of the original forward."
            )
        fresh = [c for c in matching if not c.recomputed]
        call = (fresh or matching)[-1]
        call.recomputed = True
        return call

    # --- record ---------------------------------------------------------------------------------

    def _keep(self, key: StepKey) -> None:
        entry: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for name, layer in self._layers:
            calls = self._calls.get(name, [])
            if not calls:
                continue
            dtype = torch.int16 if layer.config.num_experts <= torch.iinfo(torch.int16).max else torch.int32
            host = [c.forced_TK.to(device="cpu", dtype=dtype) for c in calls]  # SYNC: ids to host memory
            entry[name] = host[0] if len(host) == 1 else host
        if entry:
            self._pending[key] = entry

    def _flush(self) -> None:
        if not self._pending:
            return
        first_step = min(s for s, _ in self._pending)
        self.path.mkdir(parents=True, exist_ok=True)
        torch.save(self._shard_dict(self._pending), self.path / shard_name(self._rank, first_step))
        self._pending = {}

    def _shard_dict(self, steps: dict[StepKey, Any]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "rank": self._rank,
            "world_size": self._world_size,
            "layers": [name for name, _ in self._layers],
            "num_experts": {name: layer.config.num_experts for name, layer in self._layers},
            "top_k": {name: layer.config.top_k for name, layer in self._layers},
            "steps": dict(sorted(steps.items())),
        }

    # --- replay ---------------------------------------------------------------------------------

    def _index_shards(self) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"RouterReplay: path={str(self.path)!r} is not a directory; replay needs a directory written by "
                "RouterReplay(mode='record') (or in its file format)."
            )
        self._shards = {}
        for file in self.path.iterdir():
            match = _SHARD_RE.match(file.name)
            if match and int(match.group(1)) == self._rank:
                self._shards[int(match.group(2))] = file
        if not self._shards:
            raise FileNotFoundError(
                f"RouterReplay: no shard for rank {self._rank} in {str(self.path)!r} (expected files named like "
                f"{shard_name(self._rank, 0)!r}); replay with the world size of the recording."
            )
        self._loaded_first, self._loaded = None, None

    def _step_entry(self, name: str) -> dict[str, Any]:
        step, micro = self._key  # type: ignore[misc]
        firsts = [f for f in sorted(self._shards) if f <= step]
        if not firsts:
            raise self._missing(name, f"the first recorded step is {min(self._shards)}")
        if firsts[-1] != self._loaded_first:
            self._loaded = self._checked(load_shard(self._shards[firsts[-1]]), self._shards[firsts[-1]])
            self._loaded_first = firsts[-1]
        steps = self._loaded["steps"]  # type: ignore[index]
        if (step, micro) not in steps:
            recorded = sorted(steps)
            span = f"{recorded[0]}..{recorded[-1]}" if recorded else "nothing"
            raise self._missing(name, f"{self._shards[firsts[-1]].name} holds (step, micro_batch) {span}")
        return steps[(step, micro)]

    def _missing(self, name: str, detail: str) -> RuntimeError:
        step, micro = self._key  # type: ignore[misc]
        return RuntimeError(
            f"RouterReplay: no recorded routing for global_step={step}, micro_batch={micro} (layer {name!r}) in "
            f"{str(self.path)!r}: {detail}; replay with the max_steps and accumulate_grad_batches of the recording."
        )

    def _checked(self, data: dict[str, Any], file: Path) -> dict[str, Any]:
        if data.get("world_size") != self._world_size:
            raise ValueError(
                f"RouterReplay: {file} was recorded with world_size={data.get('world_size')}, this run has "
                f"world_size={self._world_size}; replay with the world size (and data order) of the recording."
            )
        names = [name for name, _ in self._layers]
        missing = [n for n in names if n not in data.get("layers", [])]
        if missing:
            raise ValueError(
                f"RouterReplay: {file} records layers {data.get('layers')}, the model has {names} "
                f"(missing {missing}); replay on the model that was recorded."
            )
        return data

    def _recorded(self, name: str, call_idx: int, computed_TK: torch.Tensor) -> torch.Tensor:
        step, micro = self._key  # type: ignore[misc]
        entry = self._step_entry(name)
        if name not in entry:
            raise RuntimeError(
                f"RouterReplay: global_step={step}, micro_batch={micro} has no routing for layer {name!r} "
                f"(it has {sorted(entry)}); replay on the model that was recorded."
            )
        value = entry[name]
        per_call = value if isinstance(value, list) else [value]
        if call_idx >= len(per_call):
            raise RuntimeError(
                f"RouterReplay: layer {name!r} ran {call_idx + 1} forwards at global_step={step}, "
                f"micro_batch={micro}, the recording has {len(per_call)}; replay the same training step."
            )
        ids_TK = per_call[call_idx]
        if tuple(ids_TK.shape) != tuple(computed_TK.shape):
            raise ValueError(
                f"RouterReplay: recorded ids for layer {name!r} at global_step={step}, micro_batch={micro} have "
                f"shape {tuple(ids_TK.shape)} [tokens, top_k], the live batch routes {tuple(computed_TK.shape)}; "
                "replay with the batch size, sequence length and top_k of the recording."
            )
        return ids_TK.to(device=computed_TK.device, dtype=torch.long, non_blocking=True)

    # --- helpers --------------------------------------------------------------------------------

    def _remove_overrides(self) -> None:
        for _, layer in self._layers:
            layer.router.set_routing_override(None)
