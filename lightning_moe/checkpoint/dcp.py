"""DCP save and load of a folded model: atomic, verified, layout-independent.

:func:`save_distributed` (every rank calls it) writes the shards with
``torch.distributed.checkpoint`` into the staging folder, rank 0 adds ``meta.pt`` (loop state,
callbacks, hyper-parameters as plain dicts) and the manifest, then publishes the folder by rename.
:func:`load_distributed` verifies the folder on rank 0 (every rank gets the verdict) before it
reads anything, loads ``w13`` from its ``gate``/``up`` halves into whatever layout this process
has (any tp, ep, etp, edp, or one process; plain or DTensor parameters), then the optimizers.

Folders written before the manifest existed (``w13`` stored whole) still load, at the ETP degree
they were saved at; the manifest records that degree for the refusal message.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_moe.checkpoint.atomic import publish, recover, staging_path
from lightning_moe.checkpoint.experts import (
    join_model_state,
    join_optimizer_state,
    split_model_state,
    split_optimizer_state,
    w13_names,
)
from lightning_moe.checkpoint.hparams import config_classes, config_from_plain, config_to_plain
from lightning_moe.checkpoint.manifest import CheckpointError, verify_checkpoint, write_manifest
from lightning_moe.checkpoint.stage_names import hf_stage_renamer, renamed_model_state, renamed_optimizer_state

__all__ = ["META_NAME", "W13_FORMAT", "W13_FORMAT_KEY", "load_distributed", "load_meta", "save_distributed", "save_staged", "verified_manifest"]

META_NAME = "meta.pt"  # Lightning's name for the non-tensor part of a DCP checkpoint
W13_FORMAT = "gate_up"
W13_FORMAT_KEY = "w13_format"  # a one-file checkpoint's marker: w13 stored as [gate | up] (W13_FORMAT)


def _expert_etp(module: nn.Module) -> int:
    from lightning_moe.moe.experts import GroupedExperts

    return max((getattr(m, "etp", 1) for m in module.modules() if isinstance(m, GroupedExperts)), default=1)


def save_distributed(
    checkpoint: dict[str, Any],
    path: str | Path,
    module: nn.Module,
    *,
    rank: int,
    barrier: Callable[[], None],
    layout: dict[str, int],
) -> None:
    """Write ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states``, the rest) as a
    DCP folder at ``path``; collective (every rank, same arguments)."""
    from torch.distributed.checkpoint import save

    path = Path(path)
    staged = _fresh_staging(path, rank, barrier)
    names = w13_names(module)
    shapes = {n: tuple(t.shape) for n, t in checkpoint["state_dict"].items() if n in names}
    converted: dict[str, Any] = {"state_dict": split_model_state(checkpoint.pop("state_dict"), names)}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        converted[f"optimizer_{idx}"] = split_optimizer_state(optim_state, names, shapes)
    rename = hf_stage_renamer(module)  # HF stages at pp > 1: saved under the whole model's names
    if rename is not None:
        converted = {k: (renamed_model_state if k == "state_dict" else renamed_optimizer_state)(v, rename)
                     for k, v in converted.items()}  # fmt: skip
    save(converted, checkpoint_id=staged)
    if rank == 0:
        torch.save(config_to_plain(checkpoint), staged / META_NAME)
        write_manifest(staged, {"w13": W13_FORMAT, "layout": {**layout, "etp": _expert_etp(module)}})
        publish(staged, path)
    barrier()


def save_staged(
    path: str | Path,
    write: Callable[[Path], None],
    *,
    rank: int,
    barrier: Callable[[], None],
    manifest: dict[str, Any] | None = None,
) -> None:
    """``write(staging path)`` on every rank, then rank 0 adds the manifest (a folder) and publishes.

    For writers that are not :func:`save_distributed` (Fabric's save); collective.
    """
    path = Path(path)
    staged = _fresh_staging(path, rank, barrier)
    write(staged)
    barrier()
    if rank == 0:
        if staged.is_dir():
            write_manifest(staged, manifest)
        publish(staged, path)
    barrier()


def load_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt`` of a DCP folder with its config dicts rebuilt (older files: classes allow-listed)."""
    file = path / META_NAME
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: file {META_NAME!r} is missing; resume from another checkpoint.")
    with torch.serialization.safe_globals(list(config_classes().values())):
        meta = torch.load(file, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    return config_from_plain(meta)


def verified_manifest(path: Path, rank: int, broadcast: Callable[[Any], Any]) -> dict[str, Any] | None:
    """Rank 0 checks the folder against its manifest; every rank raises the same error."""
    verdict: tuple[str | None, dict[str, Any] | None] = (None, None)
    if rank == 0:
        try:
            verdict = (None, verify_checkpoint(path))
        except CheckpointError as err:
            verdict = (str(err), None)
    error, manifest = broadcast(verdict)
    if error is not None:
        raise CheckpointError(error)
    return manifest


def load_distributed(
    path: str | Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    *,
    strict: bool,
    rank: int,
    broadcast: Callable[[Any], Any],
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a DCP folder into ``module`` and ``optimizers``; returns the rest (``meta.pt``).

    Collective. Raises :class:`CheckpointError` (folder and file named) before any weight changes.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    manifest = verified_manifest(path, rank, broadcast)
    split = manifest is not None and manifest.get("w13") == W13_FORMAT
    names = w13_names(module) if split else set()
    if not split:
        saved = (manifest or {}).get("layout", {}).get("etp")
        here = _expert_etp(module)
        if saved is not None and saved != here:
            raise CheckpointError(
                f"checkpoint {str(path)!r} stores w13 at etp={saved}, this run has etp={here}; load it at etp={saved}."
            )
    meta = load_meta(path, weights_only)
    model_state = get_model_state_dict(module)
    shapes = {n: tuple(t.shape) for n, t in model_state.items() if n in names}
    target = {"state_dict": split_model_state(model_state, names)}
    rename = hf_stage_renamer(module) or (lambda key: key)  # the same tensors under the saved names
    load({"state_dict": renamed_model_state(target["state_dict"], rename)}, checkpoint_id=path)
    module.load_state_dict(join_model_state(target["state_dict"], model_state, names), strict=strict)
    for idx, optimizer in enumerate(optimizers):
        key = f"optimizer_{idx}"
        current = get_optimizer_state_dict(module, optimizer)
        optim_target = {key: _without_group_params(split_optimizer_state(current, names, shapes))}
        load({key: renamed_optimizer_state(optim_target[key], rename)}, checkpoint_id=path)
        joined = _with_group_params(join_optimizer_state(optim_target[key], current, names), current)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=joined,
                                 options=StateDictOptions(cpu_offload=True))  # fmt: skip
    return meta


def _without_group_params(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its param groups' ``params`` (lists of parameter names) left out: a load
    reads the groups' hyper-parameters and keeps each group's parameters as the loading optimizer
    has them (:func:`_with_group_params`), since the names a rank holds depend on the layout (a
    pipeline stage holds other parameters than the next)."""
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state.get("param_groups", [])]
    return {**state, "param_groups": groups} if "param_groups" in state else state


def _with_group_params(loaded: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``loaded`` with each param group's ``params`` from ``current``'s group of the same index."""
    if "param_groups" not in loaded:
        return loaded
    groups = [{**group, "params": mine["params"]} for group, mine in zip(loaded["param_groups"], current["param_groups"])]
    return {**loaded, "param_groups": groups}


def _fresh_staging(path: Path, rank: int, barrier: Callable[[], None]) -> Path:
    """The empty staging path of ``path`` (a checkpoint interrupted earlier is recovered, a stale
    staging copy removed, by rank 0), once every rank has reached it; collective."""
    staged = staging_path(path)
    if rank == 0:
        recover(path)
        if staged.exists():
            shutil.rmtree(staged) if staged.is_dir() else staged.unlink()
        staged.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    return staged
