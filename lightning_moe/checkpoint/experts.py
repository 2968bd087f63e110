"""``w13`` stored as two logical tensors, ``<fqn>.gate`` and ``<fqn>.up``, each ``[E, H, F]``.

In memory ``w13 [E, H, 2F]`` is sharded over ETP as column blocks ``[gate_j | up_j]``
(``parallelize.shard_expert_weights``), so the global tensor DCP sees depends on the ETP degree
and a reshard over F scrambles gate and up. Split into halves, each is an ordinary ``Shard(2)``
DTensor (rank j holds columns ``j*f:(j+1)*f`` of gate and of up) and DCP reshards it correctly
to any ETP, EP, EDP and to one process. The experts' up-projection bias ``b13 [E, 2F]``
(``expert_mlp_bias``), sharded the same way, is split the same way (``<fqn>.gate``, ``<fqn>.up``,
each ``[E, F]``). :func:`split_model_state` / :func:`split_optimizer_state`
rewrite a state dict before a save or load; :func:`join_model_state` /
:func:`join_optimizer_state` put ``w13`` back in this process's layout after a load.
A one-file checkpoint holds full tensors: :func:`relayout_full_state` turns its ETP-blocked
``w13`` (:func:`block_w13`) into ``[gate | up]`` before the save and back after the load.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.parallel.parallelize import unblock_w13

__all__ = [
    "GATE",
    "UP",
    "block_w13",
    "join_model_state",
    "join_optimizer_state",
    "split_model_state",
    "relayout_full_state",
    "split_optimizer_state",
    "w13_etps",
    "w13_names",
]

GATE, UP = "gate", "up"


def w13_names(module: nn.Module) -> set[str]:
    """State-dict names of every ``GroupedExperts.w13`` (and ``b13``, where the experts have biases)
    under ``module``: the tensors whose last dimension is ``[gate | up]``."""
    names = set()
    for name, m in module.named_modules():
        if isinstance(m, GroupedExperts):
            prefix = f"{name}." if name else ""
            names |= {f"{prefix}w13"} | ({f"{prefix}b13"} if m.b13 is not None else set())
    return names


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s gate and up halves as tensors of the global shape ``[E, H, F]``."""
    if isinstance(t, DTensor):
        local = t.to_local()
        f = local.shape[-1] // 2
        shape = torch.Size((*t.shape[:-1], t.shape[-1] // 2))
        stride = torch.empty(shape, device="meta").stride()

        def make(x: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(x.contiguous(), t.device_mesh, t.placements, run_check=False, shape=shape,
                                      stride=stride)  # fmt: skip

        return make(local[..., :f]), make(local[..., f:])
    f = t.shape[-1] // 2
    return t[..., :f].contiguous(), t[..., f:].contiguous()


def _join(gate: torch.Tensor, up: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        local = torch.cat([gate.to_local(), up.to_local()], dim=-1)  # type: ignore[union-attr]
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())  # fmt: skip
    return torch.cat([gate, up], dim=-1)


def split_model_state(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A copy of a model state dict with each ``w13`` in ``names`` as ``.gate`` and ``.up``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in names and isinstance(value, torch.Tensor):
            out[f"{key}.{GATE}"], out[f"{key}.{UP}"] = _halves(value)
        else:
            out[key] = value
    return out


def join_model_state(loaded: dict[str, Any], like: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``loaded`` (split) with each ``w13`` back in the layout of ``like``'s tensor."""
    out = {k: v for k, v in loaded.items() if not any(k in (f"{n}.{GATE}", f"{n}.{UP}") for n in names)}
    for name in names:
        if f"{name}.{GATE}" in loaded:
            out[name] = _join(loaded[f"{name}.{GATE}"], loaded[f"{name}.{UP}"], like[name])
    return out


def _is_w13_state(value: Any, param: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape) == tuple(param)


def split_optimizer_state(state: dict[str, Any], names: set[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A copy of an optimizer state dict (names as keys, ``get_optimizer_state_dict``) with every
    ``w13``-shaped entry (``exp_avg``, ``momentum_buffer``, ...) as ``<entry>.gate`` / ``<entry>.up``."""
    per_param = state.get("state", {})
    new_state: dict[str, Any] = {}
    for key, entries in per_param.items():
        if key in names and isinstance(entries, dict):
            split: dict[str, Any] = {}
            for entry, value in entries.items():
                if _is_w13_state(value, shapes[key]):
                    split[f"{entry}.{GATE}"], split[f"{entry}.{UP}"] = _halves(value)
                else:
                    split[entry] = value
            new_state[key] = split
        else:
            new_state[key] = entries
    return {**state, "state": new_state}


def join_optimizer_state(loaded: dict[str, Any], like: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``loaded`` (split) with every ``w13``-shaped entry back in the layout of ``like``'s."""
    new_state: dict[str, Any] = {}
    for key, entries in loaded.get("state", {}).items():
        if key in names and isinstance(entries, dict):
            joined = {e: v for e, v in entries.items() if not e.endswith((f".{GATE}", f".{UP}"))}
            for entry, value in like["state"][key].items():
                if f"{entry}.{GATE}" in entries:
                    joined[entry] = _join(entries[f"{entry}.{GATE}"], entries[f"{entry}.{UP}"], value)
            new_state[key] = joined
        else:
            new_state[key] = entries
    return {**loaded, "state": new_state}


def block_w13(w13: torch.Tensor, etp: int) -> torch.Tensor:
    """``[gate | up]`` columns as the ETP-blocked ``[gate_0|up_0|gate_1|up_1|...]`` of ``etp`` ranks
    (the inverse of ``parallelize.unblock_w13``): the full tensor whose ``Shard`` over ETP gives
    rank j its ``[gate_j | up_j]``."""
    if etp == 1:
        return w13
    *lead, two_f = w13.shape
    f = two_f // (2 * etp)
    gate, up = w13[..., : two_f // 2].reshape(*lead, etp, 1, f), w13[..., two_f // 2 :].reshape(*lead, etp, 1, f)
    return torch.cat([gate, up], dim=-2).reshape(*lead, two_f)


def w13_etps(module: nn.Module) -> dict[str, int]:
    """The ETP degree of every name of :func:`w13_names` (``GroupedExperts.etp``, 1 when unsharded)."""
    out: dict[str, int] = {}
    for name, m in module.named_modules():
        if isinstance(m, GroupedExperts):
            prefix = f"{name}." if name else ""
            for tensor in ("w13", "b13") if m.b13 is not None else ("w13",):
                out[f"{prefix}{tensor}"] = getattr(m, "etp", 1)
    return out


def _relayout(value: Any, shape: tuple[int, ...], etp: int, to_blocked: bool) -> Any:
    if etp == 1 or isinstance(value, DTensor) or not _is_w13_state(value, shape):
        return value
    return block_w13(value, etp) if to_blocked else unblock_w13(value, etp)


def relayout_full_state(
    model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], etps: dict[str, int], *, to_blocked: bool
) -> None:
    """In place: every full ``w13``/``b13`` (named in ``etps``) of a model state dict and its
    optimizer entries (optimizer states keyed by parameter name) from ``[gate | up]`` to this ETP
    layout (``to_blocked``) or back."""
    shapes = {n: tuple(model_state[n].shape) for n in etps if isinstance(model_state.get(n), torch.Tensor)}
    for name, shape in shapes.items():
        model_state[name] = _relayout(model_state[name], shape, etps[name], to_blocked)
    for optim_state in optimizer_states:
        for name, entries in optim_state.get("state", {}).items():
            if name in shapes and isinstance(entries, dict):
                for entry, value in entries.items():
                    entries[entry] = _relayout(value, shapes[name], etps[name], to_blocked)
