"""Checkpoint IO of the folded strategies (``lightning_moe.checkpoint``), as plain functions.

Trainer: :func:`save_trainer_checkpoint` writes a DCP folder (``w13`` as gate/up halves, loads at
any layout) with a manifest of sizes and CRC-32s, written aside and published by rename, or one
file replaced by rename (``w13`` and its optimizer entries in the one-process ``[gate | up]``
layout, marked by :data:`W13_FORMAT_KEY`, so it too loads at any layout);
:func:`load_trainer_checkpoint` verifies a folder against its manifest before any weight changes
and loads it at this process's layout, or reads one file (the config dataclasses allow-listed; a
file consolidated from a DCP folder by Lightning's tool too) and loads it at this layout, on one
device as on many.

``ckpt_path="last"``: :func:`resume_last_or_newest_complete` makes a Trainer fall back to the
newest complete checkpoint of its ``ModelCheckpoint`` folders, with a warning naming it, when
``last`` is missing or was not published complete.

Fabric: :func:`save_fabric_checkpoint` publishes what Lightning's save writes the same way, with
the ETP degree in the manifest (Lightning's folder keeps ``w13`` at the saved layout);
:func:`check_fabric_checkpoint` verifies a folder and refuses one saved at another ETP degree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_moe.checkpoint.atomic import publish, staging_path
from lightning_moe.checkpoint.dcp import W13_FORMAT, W13_FORMAT_KEY, load_distributed, save_distributed, save_staged, verified_manifest
from lightning_moe.checkpoint.experts import relayout_full_state, w13_etps
from lightning_moe.checkpoint.hparams import config_classes, config_from_plain, config_to_plain
from lightning_moe.checkpoint.manifest import CheckpointError
from lightning_moe.checkpoint.read import join_consolidated, read_checkpoint_file
from lightning_moe.checkpoint.resume import last_or_newest_complete
from lightning_moe.parallel.mesh import FoldedMesh

__all__ = [
    "W13_FORMAT_KEY",
    "check_fabric_checkpoint",
    "load_trainer_checkpoint",
    "resume_last_or_newest_complete",
    "save_fabric_checkpoint",
    "save_trainer_checkpoint",
]



def save_trainer_checkpoint(
    checkpoint: dict[str, Any],
    path: Path,
    model: nn.Module,
    mesh: FoldedMesh,
    *,
    distributed: bool,
    rank: int,
    barrier: Callable[[], None],
) -> None:
    """A DCP folder (``distributed``; every rank calls it) or one file written by rank 0; both are
    written aside and published by rename, so a checkpoint of the same name stays readable until
    the new one is complete."""
    if distributed:
        lay = mesh.layout
        layout = {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp, "edp": lay.edp, "pp": lay.pp}
        if lay.pp > 1:
            _group_params_of_every_stage(checkpoint, mesh.group("pp"))
        save_distributed(checkpoint, path, model, rank=rank, barrier=barrier, layout=layout)
        return
    if rank == 0:
        staged = staging_path(path)
        staged.parent.mkdir(parents=True, exist_ok=True)
        _relayout_file_state(checkpoint, model, to_blocked=False)
        torch.save(config_to_plain({**checkpoint, W13_FORMAT_KEY: W13_FORMAT}), staged)
        publish(staged, path)


def _group_params_of_every_stage(checkpoint: dict[str, Any], pp_group: Any) -> None:
    """In place: each optimizer param group's ``params`` (parameter names) made the same on every
    pipeline stage: every stage's names, in pp-rank order (one object all-gather over ``pp``). A DCP
    folder keeps one copy of such an entry, and a one-file consolidation maps names to positions."""
    import torch.distributed as dist

    for optim in checkpoint.get("optimizer_states", []):
        groups = optim.get("param_groups", [])
        mine = [list(group.get("params", [])) for group in groups]
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, mine, group=pp_group)
        for index, group in enumerate(groups):
            group["params"] = [name for stage in stages for name in stage[index]]


def _relayout_file_state(checkpoint: dict[str, Any], model: nn.Module, *, to_blocked: bool) -> None:
    """In place: the full ``w13`` tensors of a one-file checkpoint (model and optimizer entries,
    the latter keyed by parameter position or name) from this run's ETP layout to ``[gate | up]``
    or back (``relayout_full_state``)."""
    names = dict(enumerate(name for name, _ in model.named_parameters()))
    by_name = [
        {"state": {names.get(k, k): v for k, v in optim.get("state", {}).items()}}
        for optim in checkpoint.get("optimizer_states", [])
    ]
    relayout_full_state(checkpoint.get("state_dict", {}), by_name, w13_etps(model), to_blocked=to_blocked)


def load_trainer_checkpoint(
    path: Path,
    model: nn.Module | None,
    optimizers: list[Optimizer],
    *,
    strict: bool,
    rank: int,
    broadcast: Callable[[Any], Any],
    weights_only: bool | None,
    load_file: Callable[[Path], dict[str, Any]],
) -> dict[str, Any]:
    """A folder: verified, then loaded into ``model`` at this layout (``load_distributed``); a file:
    loaded into ``model`` at this layout (:func:`load_file_checkpoint`); no model yet: ``load_file``
    (Lightning's load) with the config dataclasses allow-listed."""
    if path.is_dir() and model is not None:
        return load_distributed(path, model, optimizers, strict=strict, rank=rank, broadcast=broadcast,
                                weights_only=weights_only)  # fmt: skip
    if path.is_file() and model is not None:
        return load_file_checkpoint(path, model, optimizers, strict=strict, weights_only=weights_only)
    with torch.serialization.safe_globals(list(config_classes().values())):
        return config_from_plain(load_file(path))


def load_file_checkpoint(
    path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """A one-file checkpoint into ``model`` and ``optimizers`` at this process's layout (plain or
    DTensor parameters, any ETP); returns the rest of the checkpoint (without ``state_dict``).

    ``w13`` comes back in this run's ETP layout from the ``[gate | up]`` of a marked file; a file
    without the marker holds it as it was in memory and loads as stored. A file consolidated from a
    DCP folder (``join_consolidated``) loads too.
    """
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    checkpoint = join_consolidated(config_from_plain(read_checkpoint_file(path, weights_only)))
    if checkpoint.pop(W13_FORMAT_KEY, None) == W13_FORMAT:
        _relayout_file_state(checkpoint, model, to_blocked=True)
    _load_raw_module_state(checkpoint.pop("state_dict"), model, strict=strict)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    names = dict(enumerate(name for name, _ in model.named_parameters()))
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        if not sharded:
            optimizer.load_state_dict(state)
            continue
        keyed = {
            "state": {names.get(k, k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in state["param_groups"]],
        }
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=keyed, options=options)
    return checkpoint


def save_fabric_checkpoint(
    path: Path, write: Callable[[Path], None], mesh: FoldedMesh, *, rank: int, barrier: Callable[[], None]
) -> None:
    """``write(staged)`` (Lightning's save into a staging path), then a manifest with the ETP degree
    and the publishing rename (``save_staged``)."""
    save_staged(path, write, rank=rank, barrier=barrier, manifest={"layout": {"etp": mesh.layout.etp}})


def check_fabric_checkpoint(owner: str, path: Path, mesh: FoldedMesh, *, rank: int, broadcast: Callable[[Any], Any]) -> None:
    """A folder is verified against its manifest (rank 0, before anything loads); one saved at
    another ETP degree raises ``CheckpointError`` naming both."""
    if not path.is_dir():
        return
    manifest = verified_manifest(path, rank, broadcast) or {}
    saved, here = manifest.get("layout", {}).get("etp"), mesh.layout.etp
    if saved is not None and saved != here:
        raise CheckpointError(
            f"{owner}: checkpoint {str(path)!r} holds w13 at etp={saved}, this run has etp={here}; load it at etp={saved}."
        )


_FALLBACK_INSTALLED = "_lightning_moe_last_fallback"


def resume_last_or_newest_complete(module: Any) -> None:
    """Make the Trainer of ``module`` resolve ``ckpt_path="last"`` to the newest complete
    checkpoint of its ``ModelCheckpoint`` folders (those with a ``dirpath``) when the ``last``
    Lightning finds is missing or not published complete (``last_or_newest_complete``), with a
    rank-zero warning naming the file used. Once per Trainer; a module without one is left alone.

    The Trainer resolves the path (``_CheckpointConnector._parse_ckpt_path``) right after it
    attaches the module and reads the strategy's ``lightning_module``, before any process group
    exists, so every rank resolves it from the file system alike.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_warn
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = getattr(module, "_trainer", None)
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is None or getattr(connector, _FALLBACK_INSTALLED, False):
        return
    parse = connector._parse_ckpt_path

    def parse_with_fallback(state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        resolved = parse(state_fn, ckpt_path, model_provided, model_connected)
        if ckpt_path != "last":
            return resolved
        folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        path, why = last_or_newest_complete(resolved, folders)
        if why is not None:
            rank_zero_warn(why)
        return str(path) if path is not None else resolved

    connector._parse_ckpt_path = parse_with_fallback
    setattr(connector, _FALLBACK_INSTALLED, True)
