"""Load a Hugging Face safetensors checkpoint into a swapped, possibly sharded model, slice by slice.

Legend: E experts, e local experts, H hidden, F expert FFN width, f = F/etp, F_s shared-expert width.

:func:`load_hf_checkpoint_sharded` fills every parameter and persistent buffer of a model whose MoE
blocks :func:`~lightning_moe.models.hf.swap_moe_blocks` replaced (on any device; usually a model
built on ``meta``, sharded by ``parallelize_moe_model`` and materialised empty). For each tensor
it reads only this rank's part: a DTensor's local box (``Shard`` placements of EP, ETP, TP and
FSDP2, strided ones included, through ``compute_local_shape_and_global_offset``), a plain tensor
whole. Reads go through
``safe_open(...).get_slice(name)[...]`` straight into views of the local tensors, one shard file
open at a time, so a rank's memory is its own shards plus one slice.

HF names and layouts read (ours ← HF; the names per family: :mod:`~lightning_moe.checkpoint.hf_names`,
``P`` the block's checkpoint prefix, e.g. ``model.layers.0.mlp.`` or Mixtral's
``model.layers.0.block_sparse_moe.``):

* ``experts.w13 [E, H, 2F]`` (ETP: column blocks ``[gate_j | up_j]``) ← per expert
  ``P.experts.{i}.gate_proj.weight`` / ``up_proj.weight`` ``[F, H]`` (Mixtral's ``w1``/``w3``; what
  transformers 5 ``save_pretrained`` writes for most families), or a fused ``[E, 2F, H]`` tensor
  (``P.experts.gate_up_proj`` as held in memory; Granite's ``P.input_linear.weight``), or
  ``[E, H, 2F]`` (Llama 4);
* ``experts.w2 [E, F, H]`` ← ``P.experts.{i}.down_proj.weight [H, F]`` (``w2``) or fused
  ``[E, H, F]`` (``P.experts.down_proj``, ``P.output_linear.weight``), ``[E, F, H]`` (Llama 4);
  gpt-oss's gate and up columns alternate: each run of them is read with a step of 2;
* ``experts.b13 [E, 2F]`` / ``experts.b2 [E, H]`` ← ``P.experts.gate_up_proj_bias`` (gate and up as
  in ``gate_up_proj``) / ``P.experts.down_proj_bias``; ``router.bias`` ← ``P.router.bias``;
* ``router.weight`` ← the family's router (``P.gate.weight``, ``P.router.weight``,
  ``P.gate.wg.weight``, Granite's ``P.router.layer.weight``); ``router.expert_bias`` ← its correction
  bias (``P.gate.e_score_correction_bias``, ERNIE's ``P.moe_statics.e_score_correction_bias``);
* ``shared_expert.gate_up.weight [2F_s, H]`` ← ``gate_proj`` over ``up_proj`` of the family's
  shared expert (``shared_expert``, ``shared_experts``, ``shared_mlp``); ``shared_expert.down.weight``
  ← its ``down_proj``; ``shared_expert.gate.weight`` ← ``P.shared_expert_gate.weight``;
* everything else under its own name.

A layer is read under the names ``save_pretrained`` writes when its router is found there, else
under its module names (a ``state_dict`` saved as it is). A family without checkpoint names is
refused naming it.

A pipeline rank's stages (:class:`~lightning_moe.models.hf_pipeline_stage.HFLocalStages`, cut from a
``meta`` model and laid out on its pp coordinate's meshes) load the same way, their names mapped to
the HF model's (``embed.`` → ``model.embed_tokens.``, ``layers.N.`` → ``model.layers.N.``, ``norm.``
→ ``model.norm.``, ``lm_head.`` as it is; ``hf_parameter_name``): the rank reads the tensors of its
stages only (the embedding if it holds the first stage, ``model.layers.N.*`` of its stages' layers,
the final norm and the head if it holds the last), and of those only its slices as above (its EP
rank's experts, its TP, ETP and FSDP boxes). The other stages' tensors stay unread.

Bad input raises ``ValueError`` before any weight changes: a hub id or missing directory (nothing is
downloaded), missing shard files or index entries (named), a shape that does not match (key,
expected, found), a local tensor the planned reads would not fill completely (named). After the
load, :func:`reset_nonpersistent_buffers` recomputes what a checkpoint does not hold and a
materialisation left undefined (rotary frequencies; the MoE layers' counters start at zero), so
every parameter and buffer is read or set.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.checkpoint.hf_names import (
    LayerNames,
    family_named,
    module_layer_names,
    saved_layer_names,
    stored_bias_shape,
)

__all__ = [
    "HFCheckpoint",
    "load_hf_checkpoint_sharded",
    "local_box",
    "reset_nonpersistent_buffers",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpoint:
    """The tensors of a local HF checkpoint directory: name -> shard file, shapes read lazily.

    ``path`` holds ``model.safetensors.index.json`` and the shard files it names, or one
    ``model.safetensors``. Nothing is downloaded: a hub id is refused.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            hint = (
                " It looks like a hub id: nothing is downloaded here; fetch it first (e.g. `hf download "
                f"{path} --local-dir DIR`) and pass DIR."
                if isinstance(path, str) and path.count("/") == 1 and not Path(path).exists()
                else ""
            )
            raise ValueError(f"HF checkpoint {str(path)!r} is not a local directory.{hint}")
        index, single = self.path / INDEX_NAME, self.path / SINGLE_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(
                    f"HF checkpoint {str(self.path)!r}: {INDEX_NAME} has no weight_map; rewrite the index."
                )
            self.weight_map: dict[str, str] = dict(weight_map)
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self.weight_map = {name: SINGLE_NAME for name in f.keys()}  # noqa: SIM118 - safe_open has no iter
        else:
            raise ValueError(
                f"HF checkpoint {str(self.path)!r} has neither {INDEX_NAME} nor {SINGLE_NAME}; pass a directory "
                "written by save_pretrained (safetensors)."
            )
        missing = sorted({f for f in self.weight_map.values() if not (self.path / f).is_file()})
        if missing:
            raise ValueError(
                f"HF checkpoint {str(self.path)!r}: shard files {missing} named in {INDEX_NAME} are missing; "
                "copy them into the directory."
            )
        self._shapes: dict[str, tuple[int, ...]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from the shard file's header, no data read)."""
        if name not in self._shapes:
            from safetensors import safe_open

            with safe_open(str(self.path / self.weight_map[name]), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    self._shapes[key] = tuple(f.get_slice(key).get_shape())
        return self._shapes[name]

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor, read whole (name -> tensor): for checks and one-process tools, not for loading a
        model (that reads only each rank's slices)."""
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(str(self.path / file), framework="pt") as f:
                out.update({name: f.get_tensor(name) for name in names})
        return out


@dataclass
class _Read:
    """Copy ``hf[name][index]`` (transposed over its last two dims when ``transpose``) into ``dest``,
    a view of the local part of the model's tensors ``owners``."""

    name: str
    index: tuple[slice, ...]
    transpose: bool
    dest: torch.Tensor
    owners: tuple[str, ...] = ()


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """``(local tensor, its slices of the global tensor)``: a DTensor's local shard, or ``t`` whole."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = t.device_mesh
    # a placement over one rank splits nothing (FSDP2 marks its dim strided even at edp=1)
    placements = [Replicate() if mesh.size(d) == 1 else p for d, p in enumerate(t.placements)]
    for p in placements:
        if not (p.is_replicate() or isinstance(p, (Shard, _StridedShard))):
            raise ValueError(
                f"load_hf_checkpoint_sharded: placement {p} of a {tuple(t.shape)} parameter is not a Shard or "
                "Replicate; load it at a layout without it."
            )
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"load_hf_checkpoint_sharded: local shard {tuple(local.shape)} != expected {tuple(shape)}.")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _rng(s: slice) -> range:
    return range(s.start, s.stop)


def _w13_column_runs(cols: slice, F: int, etp: int) -> Iterator[tuple[int, int, int, int]]:
    """``(is_up, hf_start, dest_start, n)`` runs of blocked global columns ``cols`` of ``w13``."""
    f = F // etp
    for j in range(etp):
        for is_up in (0, 1):
            lo = 2 * f * j + is_up * f  # blocked columns of this (block, half)
            a, b = max(lo, cols.start), min(lo + f, cols.stop)
            if a < b:
                yield is_up, f * j + (a - lo), a - cols.start, b - a


class _Planner:
    """The reads that fill one model from one checkpoint, and the problems found on the way."""

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self.ckpt = ckpt
        self.reads: list[_Read] = []
        self.missing: list[str] = []
        self.mismatched: list[str] = []
        self.used: set[str] = set()
        self.owners: tuple[str, ...] = ()  # the model's tensors the reads planned now fill
        self.expected: dict[tuple[str, ...], int] = {}  # local elements of each group of owners
        self.tensor_names: list[str] = []  # every parameter and persistent buffer of the model

    def fill(self, owners: tuple[str, ...], *tensors: torch.Tensor) -> None:
        """The reads planned next fill ``tensors`` (the model's ``owners``), every local element."""
        self.owners = owners
        self.expected[owners] = sum(local_box(t)[0].numel() for t in tensors)

    def _add(self, read: _Read) -> None:
        self.reads.append(replace(read, owners=self.owners))

    def unfilled(self, names: list[str]) -> list[str]:
        """Of the model's tensors ``names``, those no read was planned for and those whose local
        elements the planned reads do not all fill (each read fills a disjoint box, so the count tells)."""
        written: dict[tuple[str, ...], int] = defaultdict(int)
        for read in self.reads:
            written[read.owners] += read.dest.numel()
        planned = {name for owners in self.expected for name in owners}
        short = {name for owners, n in self.expected.items() if written[owners] != n for name in owners}
        return [name for name in names if name not in planned or name in short]

    def _check(self, name: str, expected: tuple[int, ...]) -> bool:
        if name not in self.ckpt:
            self.missing.append(name)
            return False
        self.used.add(name)
        found = self.ckpt.shape(name)
        if tuple(found) != tuple(expected):
            self.mismatched.append(f"{name}: expected {tuple(expected)}, found {tuple(found)}")
            return False
        return True

    def direct(self, name: str, t: torch.Tensor) -> None:
        local, box = local_box(t)
        if self._check(name, tuple(t.shape)):
            self._add(_Read(name, box, False, local))

    def reshaped(self, name: str, t: torch.Tensor, stored: tuple[int, ...] | None) -> None:
        """``t`` whole (a plain tensor) from ``name`` stored as ``stored`` (same elements, e.g. ``[1, E]``)."""
        if stored is None or tuple(stored) == tuple(t.shape) or isinstance(t, DTensor):
            self.direct(name, t)
        elif self._check(name, stored):
            self._add(_Read(name, tuple(slice(0, n) for n in stored), False, t.view(stored)))

    def stacked(self, names: tuple[str, str], t: torch.Tensor) -> None:
        """``t`` = ``cat([hf[names[0]], hf[names[1]]], dim=0)``, halves of equal size."""
        local, box = local_box(t)
        half = t.shape[0] // 2
        for k, name in enumerate(names):
            if not self._check(name, (half, *t.shape[1:])):
                continue
            a, b = max(box[0].start, k * half), min(box[0].stop, (k + 1) * half)
            if a < b:
                dest = local[a - box[0].start : b - box[0].start]
                self._add(_Read(name, (slice(a - k * half, b - k * half), *box[1:]), False, dest))

    def experts(self, names: LayerNames, w13: torch.Tensor, w2: torch.Tensor, etp: int) -> None:
        E, H, two_F = w13.shape
        F = two_F // 2
        l13, (e13, h13, c13) = local_box(w13)
        l2, (e2, f2, h2) = local_box(w2)
        if names.fused is not None:
            fused_up, fused_down = names.fused
            transposed = names.transposed
            ok13 = self._check(fused_up, (E, H, 2 * F) if transposed else (E, 2 * F, H))
            ok2 = self._check(fused_down, (E, F, H) if transposed else (E, H, F))
            if ok13:
                for is_up, start, d0, n in _w13_column_runs(c13, F, etp):
                    rows = _gate_up_columns(is_up, start, n, F, names.interleaved)
                    index = (e13, h13, rows) if transposed else (e13, rows, h13)
                    self._add(_Read(fused_up, index, not transposed, l13[:, :, d0 : d0 + n]))
            if ok2:
                index = (e2, f2, h2) if transposed else (e2, h2, f2)
                self._add(_Read(fused_down, index, not transposed, l2))
            return
        for i in _rng(e13):
            gate, up, _ = names.expert(i)
            ok = [self._check(n, (F, H)) for n in (gate, up)]
            for is_up, start, d0, n in _w13_column_runs(c13, F, etp):
                if ok[is_up]:
                    dest = l13[i - e13.start, :, d0 : d0 + n]
                    self._add(_Read((gate, up)[is_up], (slice(start, start + n), h13), True, dest))
        for i in _rng(e2):
            down = names.expert(i)[2]
            if self._check(down, (H, F)):
                self._add(_Read(down, (h2, f2), True, l2[i - e2.start]))


    def expert_biases(self, names: LayerNames, b13: torch.Tensor, b2: torch.Tensor, etp: int) -> None:
        """``b13 [E, 2F]`` (ETP: blocked like ``w13``'s columns) and ``b2 [E, H]`` from the fused biases."""
        if names.expert_biases is None:
            raise ValueError(
                f"load_hf_checkpoint_sharded: {names.prefix}experts has biases but its checkpoint names are per "
                "expert; only fused expert biases (gate_up_proj_bias, down_proj_bias) are read."
            )
        E, two_F = b13.shape
        F = two_F // 2
        up_bias, down_bias = names.expert_biases
        local, (experts, cols) = local_box(b13)
        if self._check(up_bias, (E, two_F)):
            for is_up, start, d0, n in _w13_column_runs(cols, F, etp):
                index = (experts, _gate_up_columns(is_up, start, n, F, names.interleaved))
                self._add(_Read(up_bias, index, False, local[:, d0 : d0 + n]))
        self.direct(down_bias, b2)


def _gate_up_columns(is_up: int, start: int, n: int, F: int, interleaved: bool) -> slice:
    """The stored ``2F`` positions of gate (``is_up=0``) or up columns ``start:start+n``: the second
    half's, or every other one when gate and up alternate (gpt-oss)."""
    if interleaved:
        return slice(2 * start + is_up, 2 * (start + n - 1) + is_up + 1, 2)
    return slice(is_up * F + start, is_up * F + start + n)


def _moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    from lightning_moe.models.hf import HFMoELayer

    return {name: m for name, m in model.named_modules() if isinstance(m, HFMoELayer)}


def _layer_names(ckpt: HFCheckpoint, layer_name: str, layer: Any) -> LayerNames:
    """Each tensor under the name ``save_pretrained`` writes if the checkpoint has it there, else
    under its module name (module doc); the experts as a whole one way or the other."""
    from lightning_moe.models.hf import gate_up_interleaved, experts_transposed

    owner = "load_hf_checkpoint_sharded"
    saved = saved_layer_names(layer_name, layer.family, owner)
    module = module_layer_names(layer_name, layer.family, owner)
    # the in-memory layout of this transformers version (Llama 4's [E, H, 2F], or flags on the experts)
    fam, hf_experts = family_named(layer.family, owner), layer.hf_block.experts
    module = replace(module, transposed=experts_transposed(fam, hf_experts), interleaved=gate_up_interleaved(fam, hf_experts))
    first = saved.fused[0] if saved.fused is not None else saved.expert(0)[0]
    experts = saved if first in ckpt else module

    def pick(a: str | None, b: str | None) -> str | None:
        return a if a is None or a in ckpt or b not in ckpt else b

    return replace(experts, router=pick(saved.router, module.router), bias=pick(saved.bias, module.bias))


def _checkpoint_names(model: nn.Module) -> Callable[[str], str]:
    """The checkpoint name of each of ``model``'s names: the HF model's names for a pipeline rank's
    stages (``hf_parameter_name``), the names themselves for a whole model."""
    from lightning_moe.models.hf_pipeline_stage import HFLocalStages, hf_parameter_name

    if isinstance(model, HFLocalStages):
        return hf_parameter_name
    return lambda name: name


def _persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` by name (what a checkpoint holds)."""
    tensors = dict(model.named_parameters())
    skip_buffers: set[str] = set()
    for module_name, m in model.named_modules():
        skip_buffers |= {f"{module_name}.{b}" if module_name else b for b in m._non_persistent_buffers_set}
    tensors.update({n: b for n, b in model.named_buffers() if n not in skip_buffers})
    return tensors


def _plan(model: nn.Module, ckpt: HFCheckpoint) -> _Planner:
    plan = _Planner(ckpt)
    hf_name = _checkpoint_names(model)
    tensors = _persistent_tensors(model)
    done: set[str] = set()
    for layer_name, layer in _moe_layers(model).items():
        p = f"{layer_name}."
        names = _layer_names(ckpt, hf_name(layer_name), layer)
        ex = layer.experts
        plan.fill((f"{p}experts.w13", f"{p}experts.w2"), ex.w13, ex.w2)
        plan.experts(names, ex.w13, ex.w2, int(getattr(ex, "etp", 1)))
        done |= {f"{p}experts.w13", f"{p}experts.w2"}
        if getattr(ex, "b13", None) is not None and getattr(ex, "b2", None) is not None:
            plan.fill((f"{p}experts.b13", f"{p}experts.b2"), ex.b13, ex.b2)
            plan.expert_biases(names, ex.b13, ex.b2, int(getattr(ex, "etp", 1)))
            done |= {f"{p}experts.b13", f"{p}experts.b2"}
        plan.fill((f"{p}router.weight",), layer.router.weight)
        plan.direct(names.router, layer.router.weight)
        done.add(f"{p}router.weight")
        if f"{p}router.bias" in tensors and names.router_bias is not None:
            plan.fill((f"{p}router.bias",), tensors[f"{p}router.bias"])
            plan.direct(names.router_bias, tensors[f"{p}router.bias"])
            done.add(f"{p}router.bias")
        if f"{p}router.expert_bias" in tensors and names.bias is not None:
            plan.fill((f"{p}router.expert_bias",), tensors[f"{p}router.expert_bias"])
            plan.reshaped(names.bias, tensors[f"{p}router.expert_bias"], stored_bias_shape(layer))
            done.add(f"{p}router.expert_bias")
        if f"{p}shared_expert.gate_up.weight" in tensors and names.shared is not None:
            sp, gate_up, down = names.shared, f"{p}shared_expert.gate_up.weight", f"{p}shared_expert.down.weight"
            plan.fill((gate_up,), tensors[gate_up])
            plan.stacked((f"{sp}gate_proj.weight", f"{sp}up_proj.weight"), tensors[gate_up])
            plan.fill((down,), tensors[down])
            plan.direct(f"{sp}down_proj.weight", tensors[down])
            done |= {gate_up, down}
        if f"{p}shared_expert.gate.weight" in tensors and names.shared_gate is not None:
            plan.fill((f"{p}shared_expert.gate.weight",), tensors[f"{p}shared_expert.gate.weight"])
            plan.direct(names.shared_gate, tensors[f"{p}shared_expert.gate.weight"])
            done.add(f"{p}shared_expert.gate.weight")
    for name, t in tensors.items():
        if name in done:
            continue
        plan.fill((name,), t)
        plan.direct(hf_name(name), t)
    plan.tensor_names = list(tensors)
    return plan


def _raise_problems(plan: _Planner) -> None:
    if plan.missing:
        shown = ", ".join(plan.missing[:8]) + (f" (+{len(plan.missing) - 8} more)" if len(plan.missing) > 8 else "")
        raise ValueError(
            f"HF checkpoint {str(plan.ckpt.path)!r} has no tensor {shown} (not in its index or file); "
            "the checkpoint does not match the model's config."
        )
    if plan.mismatched:
        raise ValueError(
            f"HF checkpoint {str(plan.ckpt.path)!r}: tensor shapes do not match the model: "
            + "; ".join(plan.mismatched[:8])
            + ". Check that config.json belongs to these weights."
        )
    unfilled = plan.unfilled(plan.tensor_names)
    if unfilled:
        shown = ", ".join(unfilled[:8]) + (f" (+{len(unfilled) - 8} more)" if len(unfilled) > 8 else "")
        raise ValueError(
            f"load_hf_checkpoint_sharded: loading {str(plan.ckpt.path)!r} would leave {shown} unset, in whole or "
            "in part (no checkpoint tensor is read into some of their local elements); load this model with "
            "load_sharded=False."
        )


@torch.no_grad()
def load_hf_checkpoint_sharded(model: nn.Module, checkpoint: str | Path | HFCheckpoint) -> list[str]:
    """Fill ``model`` (a swapped HF model, or a pipeline rank's ``HFLocalStages``; plain or DTensor
    parameters) from an HF checkpoint directory.

    Every parameter and persistent buffer is read: this rank's local part only, one shard file at
    a time (module doc); a rank's stages read only their own tensors, under the HF model's names.
    Values are cast to each tensor's dtype. Nothing changes unless every tensor is found with the
    right shape and the reads fill every local element (else ``ValueError`` naming the keys).
    Returns the checkpoint's names that were not used (e.g. ``lm_head.weight`` of tied embeddings,
    the other pipeline stages' tensors, the other EP ranks' experts when stored per expert).
    Non-persistent buffers are not touched (see :func:`reset_nonpersistent_buffers`). Collective-free.
    """
    ckpt = checkpoint if isinstance(checkpoint, HFCheckpoint) else HFCheckpoint(checkpoint)
    plan = _plan(model, ckpt)
    _raise_problems(plan)
    by_file: dict[str, list[_Read]] = defaultdict(list)
    for read in plan.reads:
        by_file[ckpt.weight_map[read.name]].append(read)
    from safetensors import safe_open

    for file in sorted(by_file):
        with safe_open(str(ckpt.path / file), framework="pt", device="cpu") as f:
            for read in by_file[file]:
                if read.dest.numel() == 0:
                    continue
                part = f.get_slice(read.name)[read.index]
                read.dest.copy_(part.transpose(-2, -1) if read.transpose else part)
                del part
    return sorted(set(ckpt.weight_map) - plan.used)


@torch.no_grad()
def reset_nonpersistent_buffers(model: nn.Module) -> None:
    """Recompute the buffers a checkpoint does not hold, after an empty materialisation.

    Rotary-embedding modules (``*RotaryEmbedding`` with a ``config``) get the frequencies a fresh
    module computes; every other non-persistent buffer (the MoE layers' aux-loss counters) starts
    at zero, as after :func:`~lightning_moe.models.hf.swap_moe_blocks`.
    """
    for m in model.modules():
        names = set(m._non_persistent_buffers_set)
        if not names:
            continue
        fresh: Any = None
        if "RotaryEmbedding" in type(m).__name__ and getattr(m, "config", None) is not None:
            with torch.device("cpu"):
                fresh = type(m)(config=m.config)
        for name in names:
            buf = getattr(m, name, None)
            if not isinstance(buf, torch.Tensor):
                continue
            src = getattr(fresh, name, None) if fresh is not None else None
            if isinstance(src, torch.Tensor) and src.shape == buf.shape:
                buf.copy_(src)
            else:
                buf.zero_()
