"""Checkpoint IO of the folded strategies (``lightning_moe.checkpoint``), as plain functions.

Trainer: :func:`save_trainer_checkpoint` writes a DCP folder (``w13`` as gate/up halves, loads at
any layout) with a manifest of sizes and CRC-32s, written aside and published by rename, or one
file replaced by rename; :func:`load_trainer_checkpoint` verifies a folder against its manifest
before any weight changes and loads it at this process's layout, or reads one file with the config
dataclasses allow-listed.

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
from lightning_moe.checkpoint.dcp import load_distributed, save_distributed, save_staged, verified_manifest
from lightning_moe.checkpoint.hparams import config_classes, config_from_plain, config_to_plain
from lightning_moe.checkpoint.manifest import CheckpointError
from lightning_moe.parallel.mesh import FoldedMesh

__all__ = ["check_fabric_checkpoint", "load_trainer_checkpoint", "save_fabric_checkpoint", "save_trainer_checkpoint"]


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
        layout = {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp, "edp": lay.edp}
        save_distributed(checkpoint, path, model, rank=rank, barrier=barrier, layout=layout)
        return
    if rank == 0:
        staged = staging_path(path)
        torch.save(config_to_plain(checkpoint), staged)
        publish(staged, path)


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
    """A folder: verified, then loaded into ``model`` at this layout (``load_distributed``); a file
    (or no model yet): ``load_file`` (Lightning's load) with the config dataclasses allow-listed."""
    if path.is_dir() and model is not None:
        return load_distributed(path, model, optimizers, strict=strict, rank=rank, broadcast=broadcast,
                                weights_only=weights_only)  # fmt: skip
    with torch.serialization.safe_globals(list(config_classes().values())):
        return config_from_plain(load_file(path))


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
