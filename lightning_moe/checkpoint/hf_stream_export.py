"""Write a swapped, sharded model as an HF safetensors directory, every rank its own files.

Legend: E experts, e local experts, H hidden, F expert FFN width, F_s shared-expert width.

:func:`stream_export_hf` is collective over ``group`` (every rank calls it with the same model
layout). Tensors are taken one at a time in the model's order:

* experts (``w13``/``w2`` DTensors): gathered over every mesh dim but the expert one (EDP's H
  shards, ETP's column blocks, undone with ``unblock_w13``), so each EP rank holds only its experts
  of one layer at a time; one replica of that EP rank writes them per expert, in the layout
  transformers 5 ``save_pretrained`` writes (``P.experts.{i}.gate_proj.weight [F, H]``,
  ``up_proj``, ``down_proj [H, F]``, or the family's names);
* other tensors (FSDP2 and TP DTensors through ``full_tensor``, one tensor at a time; plain ones
  as they are): written by one rank of ``group``, each rank in turn;
* names back to the ones transformers' ``save_pretrained`` writes for the family
  (``checkpoint.hf_names``: ``router.weight`` → ``gate.weight`` / ``router.weight`` / Granite's
  ``router.layer.weight``, Mixtral's ``block_sparse_moe.experts.{i}.w1``, the shared expert's
  ``gate_up`` split into ``gate_proj``/``up_proj``, ...; the inverse of ``checkpoint.hf_sharded``);
  families saved with fused experts (Granite's ``input_linear``, Llama 4's ``experts.gate_up_proj``)
  get each expert tensor whole, gathered over every mesh dim and written by one rank in turn.

A rank writes ``model-rank{r}-{k}.safetensors`` files of at most ``max_shard_bytes`` each; then,
after the names of every rank are collected (``all_gather_object``), rank 0 writes
``model.safetensors.index.json`` and ``config.json``. A checkpoint loaded with
:func:`~lightning_moe.checkpoint.hf_sharded.load_hf_checkpoint_sharded` and exported untouched is
the same tensors bit for bit. A family without checkpoint names is refused naming it; expert
biases are written only where the family stores its experts fused (gpt-oss).

:func:`stream_export_dcp` does the same from a ``folded_moe`` DCP folder (``lightning-moe-export
--streaming`` under ``torchrun``): each rank reads only its shards of the folder and writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_moe.checkpoint.hf_names import LayerNames, saved_layer_names, stored_bias_shape
from lightning_moe.checkpoint.hf_sharded import INDEX_NAME

__all__ = ["hf_tensors", "stream_export_dcp", "stream_export_hf"]


def _replica_index(t: DTensor, keep: list[bool]) -> tuple[int, int]:
    """This rank's index among the ranks holding the same data after gathering the dims not kept."""
    mesh = t.device_mesh
    index, count = 0, 1
    for dim in range(mesh.ndim):
        if keep[dim]:
            continue
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
        count *= mesh.size(dim)
    return index, count


def _gather_experts(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(local experts whole, first expert, replica index, replicas)`` of an expert weight."""
    if not isinstance(t, DTensor):
        return t.detach(), 0, 0, 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    keep = [type(p) is Shard and p.dim == 0 for p in t.placements]
    target = [Shard(0) if k else Replicate() for k in keep]
    local = t.detach().redistribute(t.device_mesh, target).to_local()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, target)
    index, count = _replica_index(t, keep)
    return local, int(offset[0]), index, count


class _Turns:
    """Which rank writes the next tensor held by several ranks: each in turn."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.count = rank, world, 0

    def mine(self, index: int, replicas: int) -> bool:
        turn = self.count % replicas
        self.count += 1
        return index == turn


def _whole(t: torch.Tensor, turns: _Turns) -> torch.Tensor | None:
    """``t`` whole on the rank whose turn it is (``None`` elsewhere); collective for DTensors.

    Every rank holds a part or a copy of every tensor that is not an expert weight (ranks outside
    a DTensor's mesh, e.g. the TP ranks of an FSDP-only weight, hold copies), so the turn goes
    over the whole group."""
    full = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
    return full if turns.mine(turns.rank, turns.world) else None


def _layer_names(layers: dict[str, Any]) -> dict[str, LayerNames]:
    """``save_pretrained``'s names of every layer (``checkpoint.hf_names``); unknown families and
    layers the HF block cannot hold are refused before any collective."""
    from lightning_moe.models.hf import check_exportable

    names = {}
    for name, layer in layers.items():
        names[f"{name}."] = saved_layer_names(name, layer.family, "stream_export_hf")
        check_exportable(layer)
    return names


_FUSED = ("experts.w13", "experts.w2", "experts.b13", "experts.b2")


def _fused_experts(rest: str, full: torch.Tensor, names: LayerNames, etp: int) -> tuple[str, torch.Tensor]:
    """A family saved with fused experts: the whole ``[E, H, 2F]`` / ``[E, F, H]`` tensor (or bias
    ``[E, 2F]`` / ``[E, H]``) in its layout: gate and up back from ETP's blocks, interleaved again
    for gpt-oss."""
    from lightning_moe.models.hf import interleave_gate_up
    from lightning_moe.parallel.parallelize import unblock_w13

    assert names.fused is not None
    if rest in ("experts.w13", "experts.b13"):
        full = unblock_w13(full, etp)
        full = interleave_gate_up(full) if names.interleaved else full
    if rest in ("experts.b13", "experts.b2"):
        if names.expert_biases is None:
            raise ValueError(f"stream_export_hf: {names.prefix}experts has biases that its checkpoint cannot hold.")
        return names.expert_biases[0 if rest == "experts.b13" else 1], full
    name = names.fused[0] if rest == "experts.w13" else names.fused[1]
    return name, (full if names.transposed else full.transpose(1, 2))


def _etp(layer: nn.Module) -> int:
    """The ETP degree of a layer's experts (1 when they are not split in blocks)."""
    return int(getattr(layer.experts, "etp", 1))


def _saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``model`` by name, in the model's order."""
    skip: set[str] = set()
    for module_name, m in model.named_modules():
        skip |= {f"{module_name}.{b}" if module_name else b for b in m._non_persistent_buffers_set}
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n not in skip})
    return tensors


def _per_expert(
    rest: str, t: torch.Tensor, names: LayerNames, etp: int, turns: _Turns
) -> Iterator[tuple[str, torch.Tensor]]:
    """An expert weight as one tensor per expert, written by one replica of each EP rank."""
    local, first, index, count = _gather_experts(t)
    if not turns.mine(index, count):
        return
    if rest == "experts.w13":
        from lightning_moe.parallel.parallelize import unblock_w13

        local = unblock_w13(local, etp)
        F = local.shape[-1] // 2
    for i in range(local.shape[0]):
        gate, up, down = names.expert(first + i)
        if rest == "experts.w13":
            yield gate, local[i, :, :F].t()
            yield up, local[i, :, F:].t()
        else:
            yield down, local[i].t()


def _renamed(
    key: str, rest: str, full: torch.Tensor, names: LayerNames, bias_shape: tuple[int, ...] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's router or shared-expert tensor under its ``save_pretrained`` name(s)."""
    if rest == "router.weight":
        yield names.router, full
    elif rest == "router.bias" and names.router_bias is not None:
        yield names.router_bias, full
    elif rest == "router.expert_bias" and names.bias is not None:
        yield names.bias, full.view(bias_shape or full.shape)
    elif rest == "shared_expert.gate_up.weight" and names.shared is not None:
        Fs = full.shape[0] // 2
        yield f"{names.shared}gate_proj.weight", full[:Fs]
        yield f"{names.shared}up_proj.weight", full[Fs:]
    elif rest == "shared_expert.down.weight" and names.shared is not None:
        yield f"{names.shared}down_proj.weight", full
    elif rest == "shared_expert.gate.weight" and names.shared_gate is not None:
        yield names.shared_gate, full
    else:
        yield key, full


def hf_tensors(model: nn.Module, rank: int = 0, world: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` this rank writes, in order; collective for sharded models (every rank
    iterates to the end)."""
    from lightning_moe.models.hf import HFMoELayer

    layers = {n: m for n, m in model.named_modules() if isinstance(m, HFMoELayer)}
    by_layer = _layer_names(layers)
    hf_bias_shapes = {f"{n}.": stored_bias_shape(layer) for n, layer in layers.items()}  # ERNIE's [1, E]
    turns = _Turns(rank, world)
    for key, t in _saved_tensors(model).items():
        prefix = next((p for p in by_layer if key.startswith(p)), None)
        names, rest = (by_layer[prefix], key[len(prefix) :]) if prefix is not None else (None, key)
        if names is not None and rest in ("experts.w13", "experts.w2") and names.fused is None:
            yield from _per_expert(rest, t, names, _etp(layers[prefix[:-1]]), turns)
            continue
        if names is not None and rest in ("experts.b13", "experts.b2") and names.fused is None:
            raise ValueError(f"stream_export_hf: {key}: per-expert HF checkpoint names hold no expert biases.")
        full = _whole(t, turns)  # a fused expert tensor holds every expert: written whole by one rank
        if full is None:
            continue
        if names is None:
            yield key, full
        elif rest in _FUSED:
            yield _fused_experts(rest, full, names, _etp(layers[prefix[:-1]]))
        else:
            yield from _renamed(key, rest, full, names, hf_bias_shapes[prefix])


def _collect(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def stream_export_hf(
    model: nn.Module,
    out_dir: str | Path,
    *,
    group: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    config: Any = None,
) -> Path:
    """Write ``model`` (a swapped HF model, plain or sharded) to ``out_dir`` as HF safetensors.

    Args:
        model: the HF model after ``swap_moe_blocks`` (``HFMoELanguageModel.model``), on any layout.
        out_dir: created if missing; every rank must see the same folder.
        group: the process group of every rank holding a part of ``model`` (``None``: one process).
        dtype: cast floating tensors before writing (``None`` keeps each tensor's dtype).
        max_shard_bytes: the most bytes of one file (a larger tensor gets a file of its own).
        config: the ``PretrainedConfig`` written as ``config.json`` (default ``model.config``);
            ``output_router_logits`` is restored as the swap found it.

    Returns the folder; ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"stream_export_hf: max_shard_bytes={max_shard_bytes!r} must be a positive int.")
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if group is not None:
        dist.barrier(group=group)
    files = _RankFiles(out, rank, max_shard_bytes)
    for name, t in hf_tensors(model, rank, world):
        files.add(name, t if dtype is None or not t.is_floating_point() else t.to(dtype))
    files.flush()
    reports = _collect((files.names, files.total), group)
    if rank == 0:
        _write_index(out, reports)
        _write_config(model, out, config, dtype)
    if group is not None:
        dist.barrier(group=group)
    return out


class _RankFiles:
    """This rank's ``model-rank{r}-{k}.safetensors`` files, each of at most ``max_bytes`` (a larger
    tensor gets a file of its own); ``names`` maps each written tensor to its file."""

    def __init__(self, out: Path, rank: int, max_bytes: int) -> None:
        self.out, self.rank, self.max_bytes = out, rank, max_bytes
        self.names: dict[str, str] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.size = self.total = self.part = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t.clone(memory_format=torch.contiguous_format)  # its own storage, for safetensors
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f"model-rank{self.rank:05d}-{self.part:05d}.safetensors"
        save_file(self.pending, str(self.out / file), metadata={"format": "pt"})
        self.names.update(dict.fromkeys(self.pending, file))
        self.pending, self.size, self.part = {}, 0, self.part + 1


def _write_index(out: Path, reports: list[tuple[dict[str, str], int]]) -> None:
    """``model.safetensors.index.json`` from every rank's ``(names, bytes)``; a tensor written by two
    ranks is an error."""
    weight_map: dict[str, str] = {}
    for rank_names, _ in reports:
        clash = set(weight_map) & set(rank_names)
        if clash:
            raise RuntimeError(f"stream_export_hf: tensors {sorted(clash)[:4]} written by two ranks.")
        weight_map.update(rank_names)
    index = {"metadata": {"total_size": sum(t for _, t in reports)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(model: nn.Module, out: Path, config: Any, dtype: torch.dtype | None) -> None:
    import copy

    from lightning_moe.models.hf import HFMoELayer

    config = copy.deepcopy(config if config is not None else model.config)
    restore = next((m.hf_output_router_logits for m in model.modules() if isinstance(m, HFMoELayer)), None)
    if restore is not None and hasattr(config, "output_router_logits"):
        config.output_router_logits = restore
    if dtype is not None:
        config.dtype = dtype
    else:
        first = next((p for p in model.parameters() if p.is_floating_point()), None)
        if first is not None:
            config.dtype = first.dtype
    config.save_pretrained(str(out))


def _nest(model: nn.Module, prefix: str) -> nn.Module:
    """A root holding ``model`` under the dotted attribute path ``prefix`` (``"model."``), so its
    state-dict keys are the LightningModule's."""
    root = model
    for attr in reversed([a for a in prefix.split(".") if a]):
        parent = nn.Module()
        parent.add_module(attr, root)
        root = parent
    return root


def stream_export_dcp(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    group: Any,
    hf_config: Any = None,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    ep: int | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """A ``folded_moe`` DCP folder → HF safetensors, every rank of ``group`` reading and writing its part.

    Collective over ``group`` (the default group: ``torchrun`` ranks on one or more hosts). The
    swapped HF model is built on ``meta`` from ``hf_config`` or the checkpoint's ``hf_config`` /
    ``pretrained`` hyper-parameters, laid out with experts over ``ep`` ranks (default: the
    world size, or the largest divisor of it that divides the expert count) and FSDP2 over the rest,
    filled from the folder (each rank reads its shards; the manifest is verified first) and written
    with :func:`stream_export_hf`.
    """
    from lightning_moe.checkpoint.dcp import load_distributed, load_meta
    from lightning_moe.checkpoint.hf_sharded import reset_nonpersistent_buffers

    if group is None or not dist.is_initialized():
        raise ValueError(
            "stream_export_dcp: needs an initialised process group (run under torchrun); for one process use "
            "lightning_moe.export.export_checkpoint."
        )
    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(f"stream_export_dcp: {str(path)!r} is not a DCP checkpoint directory.")
    hparams = dict(load_meta(path).get("hyper_parameters", {}))
    config = _checkpoint_hf_config(path, hf_config, hparams)
    model, root = _laid_out_meta_model(config, hparams.get("moe") or {}, dist.get_world_size(group), ep, prefix)

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    load_distributed(path, root, [], strict=True, rank=dist.get_rank(group), broadcast=broadcast)
    reset_nonpersistent_buffers(model)
    return stream_export_hf(model, out_dir, group=group, dtype=dtype, max_shard_bytes=max_shard_bytes, config=config)


def _checkpoint_hf_config(path: Path, hf_config: Any, hparams: dict[str, Any]) -> Any:
    """The ``PretrainedConfig`` to export with: ``hf_config`` when given, else the checkpoint's
    ``hf_config`` / ``pretrained`` hyper-parameters."""
    from lightning_moe.models.hf_config import hf_config_from

    pretrained = None
    if hf_config is None:
        hf_config, pretrained = hparams.get("hf_config"), hparams.get("pretrained")
        if hf_config is None and pretrained is None:
            raise ValueError(f"stream_export_dcp: {path} names no HF config (no hf_config/pretrained); pass hf_config.")
    return hf_config_from(hf_config, pretrained, owner="stream_export_dcp")


def _laid_out_meta_model(
    config: Any, moe_overrides: dict[str, Any], world: int, ep: int | None, prefix: str
) -> tuple[nn.Module, nn.Module]:
    """``(swapped HF model, root holding it under prefix)``: built on ``meta``, experts over ``ep``
    ranks (default: the largest divisor of ``world`` that divides every expert count), FSDP2 over
    the rest, then given empty CPU storage to load into."""
    import math

    from transformers import AutoModelForCausalLM

    from lightning_moe.models.hf import swap_moe_blocks
    from lightning_moe.moe.layer import MoELayer
    from lightning_moe.parallel.layout import FoldedLayout
    from lightning_moe.parallel.mesh import FoldedMesh
    from lightning_moe.parallel.parallelize import parallelize_moe_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    swap_moe_blocks(model, **moe_overrides)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if ep is None:
        ep = math.gcd(world, *(m.config.num_experts for m in layers)) if layers else 1
    mesh = FoldedMesh.build(FoldedLayout(world, ep=ep), "cpu")
    root = _nest(model, prefix)
    parallelize_moe_model(root, mesh=mesh, dispatcher="alltoall")
    root.to_empty(device="cpu")
    return model, root
