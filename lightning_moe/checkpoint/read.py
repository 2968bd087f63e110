"""Read a checkpoint whole, on one process, without a process group.

:func:`load_checkpoint` takes a Lightning ``.ckpt`` file or a DCP folder as the ``folded_moe`` /
``ModelParallelStrategy`` write it (``.metadata`` + shards, the hyper-parameters in ``meta.pt``,
read by :func:`~lightning_moe.checkpoint.dcp.load_meta`). A folder is verified against its
manifest first; sharded tensors (DTensors of any layout: ep, etp, tp, edp) come back whole, and the
experts' ``w13`` as one ``[gate | up]`` tensor (:func:`join_w13`), the one-process layout.

Exports and ``lightning-moe generate`` read checkpoints through this module; resuming training
(every rank its own shards) goes through :func:`~lightning_moe.checkpoint.dcp.load_distributed`.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.dcp import META_NAME, load_meta
from lightning_moe.checkpoint.hparams import config_classes, config_from_plain
from lightning_moe.checkpoint.manifest import verify_checkpoint

__all__ = ["join_consolidated", "join_w13", "load_checkpoint", "read_checkpoint_file"]


def load_checkpoint(path: str | Path, *, owner: str = "load_checkpoint") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(model state dict, hyper-parameters)`` of a Lightning ``.ckpt`` file or a DCP folder.

    A folder without ``meta.pt`` has no hyper-parameters (``{}``). Files that hold classes other
    than the config dataclasses load only with ``weights_only=False``, with a warning. ``owner``
    starts every error message and the warning.
    """
    path = Path(path)
    if path.is_dir():
        verify_checkpoint(path)
        meta: dict[str, Any] = {}
        if (path / META_NAME).is_file():
            meta = _trusted_load(path, owner, lambda weights_only: load_meta(path, weights_only))
        return join_w13(_dcp_model_state(path, owner)), dict(meta.get("hyper_parameters", {}))
    if not path.is_file():
        raise ValueError(f"{owner}: checkpoint {path} does not exist; pass a .ckpt file or a DCP directory.")
    ckpt = join_consolidated(_trusted_load(path, owner, lambda weights_only: read_checkpoint_file(path, weights_only)))
    if "state_dict" not in ckpt:
        raise ValueError(
            f"{owner}: {path} has no 'state_dict' (keys: {sorted(ckpt)}); pass a Lightning checkpoint."
        )
    return ckpt["state_dict"], config_from_plain(dict(ckpt.get("hyper_parameters", {})))


def join_w13(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``<name>.w13.gate`` and ``<name>.w13.up`` (how ``folded_moe`` stores the experts in a DCP
    folder, any layout) as one ``<name>.w13`` ``[gate | up]``, the one-process layout; the same for
    the experts' bias ``<name>.b13``."""
    return _join_halves(state_dict, lambda stem: stem.endswith((".w13", ".b13")))


def _join_halves(mapping: dict[str, Any], joins: Callable[[str], bool]) -> dict[str, Any]:
    """``<stem>.gate`` and ``<stem>.up`` as one ``<stem>`` (concatenated on the last dimension)
    for every stem that ``joins``; other keys unchanged."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        stem, _, half = key.rpartition(".")
        if half == "gate" and joins(stem) and f"{stem}.up" in mapping:
            out[stem] = torch.cat([value, mapping[f"{stem}.up"]], dim=-1)
        elif not (half == "up" and joins(stem) and f"{stem}.gate" in mapping):
            out[key] = value
    return out


def join_consolidated(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """In place, and returned: a DCP folder made one file by Lightning's
    ``consolidate_checkpoint`` tool as a Lightning one-process checkpoint.

    Its ``state_dict`` holds ``w13`` as ``.gate``/``.up`` halves: joined (:func:`join_w13`). Its
    optimizers are ``optimizer_0``, ``optimizer_1``, ... keyed by parameter name, ``w13``'s
    entries as halves too: joined and keyed by position, as ``optimizer_states``. Any other
    checkpoint comes back unchanged.
    """
    if isinstance(checkpoint.get("state_dict"), dict):
        checkpoint["state_dict"] = join_w13(checkpoint["state_dict"])
    prefix = "optimizer_"
    indices = sorted(int(k[len(prefix) :]) for k in checkpoint if k.startswith(prefix) and k[len(prefix) :].isdigit())
    if indices and "optimizer_states" not in checkpoint:
        checkpoint["optimizer_states"] = [_positional(checkpoint.pop(f"optimizer_{i}")) for i in indices]
    return checkpoint


def _positional(optim_state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``) keyed by position in its param
    groups (``torch.optim.Optimizer.state_dict``), ``w13``'s split entries joined."""
    names = [name for group in optim_state.get("param_groups", []) for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    state = {position.get(name, name): _join_entries(entries) for name, entries in optim_state.get("state", {}).items()}
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in optim_state.get("param_groups", [])]
    return {"state": state, "param_groups": groups}


def _join_entries(entries: Any) -> Any:
    """One parameter's optimizer entries with ``<entry>.gate``/``<entry>.up`` joined (``w13``'s)."""
    return _join_halves(entries, lambda stem: True) if isinstance(entries, dict) else entries


def read_checkpoint_file(path: Path, weights_only: bool | None) -> Any:
    """``torch.load`` of a one-file checkpoint on the CPU, the config dataclasses allow-listed."""
    with torch.serialization.safe_globals(list(config_classes().values())):
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def _trusted_load(path: Path, owner: str, load: Callable[[bool], Any]) -> Any:
    """``load(weights_only=True)``; a file that needs more loads with ``weights_only=False`` and a warning."""
    try:
        return load(True)
    except pickle.UnpicklingError:  # hyper-parameters may hold other classes: the user's own checkpoint
        warnings.warn(
            f"{owner}: {path} needs weights_only=False to load; only load checkpoints you trust.", stacklevel=3
        )
        return load(False)


def _dcp_model_state(path: Path, owner: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    # Only the model's entries (not the optimizer's), on this process, no process group;
    # DTensor shards (FSDP2, expert parallel) come back as whole tensors.
    state = _load_state_dict_from_keys(keys={"state_dict"}, checkpoint_id=str(path))
    if "state_dict" not in state:
        raise ValueError(
            f"{owner}: the distributed checkpoint {path} has no 'state_dict' entry (keys: {sorted(state)}); "
            "pass a checkpoint written by Trainer.save_checkpoint."
        )
    return state["state_dict"]
