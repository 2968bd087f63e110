"""FoldedMesh: the dense and the expert DeviceMesh views of one world.

A :class:`~lightning_moe.parallel.layout.FoldedLayout` is rank algebra only; this file turns it
into process groups. It is the only place in the package that builds groups:
everything below (``parallelize``, the dispatchers, the layers) receives a mesh or a group.

Stages of :meth:`FoldedMesh.build` (every rank must call it, in the same order):

1. validate nothing new — the layout was already checked before any collective;
2. ``DeviceMesh(dense)``: axes ``(pp, dp, cp, tp)`` in the order string's slowest-first order,
   one ``new_group`` per axis (collective over WORLD);
3. ``DeviceMesh(expert)``: axes ``(pp, edp, ep, etp)`` over the same ranks (collective over
   WORLD);
4. flattened axes ``dp_cp``, ``tp_cp`` (dense) and ``tp_ep`` (expert: etp x ep) by
   ``DeviceMesh._flatten`` (one more group each, collective over WORLD).

Both meshes share the world, so a rank's coordinate in one is independent of the other: the
dense view decides who shares attention weights, the expert view who shares experts. Axis names
are the ``FoldedLayout`` names (``AXIS_NAMES``).

Pipeline parallel: both meshes carry the ``pp`` axis at the same stride (``FoldedLayout`` refuses
an order where they would differ), so their pp groups hold the same ranks; ``mesh("pp")`` and
``group("pp")`` are the dense mesh's, the one group a pipeline sends activations over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe.parallel.layout import AXIS_NAMES, FoldedLayout, MeshKind

__all__ = ["FoldedMesh", "build_device_mesh"]

# flattened axis -> (mesh kind, the single axes it joins, fastest-varying last as in the mesh)
_FLAT: dict[str, tuple[MeshKind, tuple[str, ...]]] = {
    "dp_cp": ("dense", ("dp", "cp")),
    "tp_cp": ("dense", ("cp", "tp")),
    "tp_ep": ("expert", ("ep", "etp")),
}
_SINGLE: dict[str, MeshKind] = {"tp": "dense", "cp": "dense", "dp": "dense", "pp": "dense"}
_SINGLE |= {"ep": "expert", "etp": "expert", "edp": "expert"}


def build_device_mesh(layout: FoldedLayout, kind: MeshKind, device_type: str) -> DeviceMesh:
    """One factorization as a DeviceMesh (collective: creates one group per axis over WORLD)."""
    shape = layout.mesh_shape(kind)
    ranks = torch.tensor(shape.ranks, dtype=torch.int).reshape(shape.sizes)
    return DeviceMesh(device_type, ranks, mesh_dim_names=shape.names)


@dataclass
class FoldedMesh:
    """Dense and expert DeviceMeshes of one world, with named 1-D views for every axis.

    Build with :meth:`build` after the default process group exists. ``mesh(name)`` returns the
    1-D DeviceMesh of an axis (``tp cp pp dp dp_cp tp_cp ep etp edp tp_ep``), ``group(name)``
    its ProcessGroup for this rank, ``rank(name)``/``size(name)`` this rank's coordinate and the
    group size.
    """

    layout: FoldedLayout
    dense: DeviceMesh
    expert: DeviceMesh
    _flat: dict[str, DeviceMesh] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: FoldedLayout, device_type: str = "cpu") -> FoldedMesh:
        """Create both meshes and the flattened views (collectives over WORLD on every rank)."""
        dense = build_device_mesh(layout, "dense", device_type)
        expert = build_device_mesh(layout, "expert", device_type)
        out = cls(layout, dense, expert)
        for name, (kind, axes) in _FLAT.items():
            root = dense if kind == "dense" else expert
            ordered = tuple(a for a in root.mesh_dim_names or () if a in axes)
            out._flat[name] = root[ordered]._flatten(name)
        return out

    def mesh(self, name: str) -> DeviceMesh:
        """The 1-D DeviceMesh of axis ``name``; raises ``ValueError`` for other names."""
        if name in self._flat:
            return self._flat[name]
        if name not in _SINGLE:
            raise ValueError(f"FoldedMesh: name={name!r} is not an axis name; use one of {AXIS_NAMES}.")
        root = self.dense if _SINGLE[name] == "dense" else self.expert
        return root[name]

    def group(self, name: str) -> ProcessGroup:
        """This rank's ProcessGroup of axis ``name``."""
        return self.mesh(name).get_group()

    def size(self, name: str) -> int:
        return self.layout.size(name)

    def rank(self, name: str) -> int:
        """This rank's coordinate (local rank) inside its group of axis ``name``."""
        return self.mesh(name).get_local_rank()

    @property
    def expert_shard_mesh(self) -> DeviceMesh:
        """The mesh expert parameters are DTensors over before FSDP: ``ep`` (or ``(ep, etp)``)."""
        if self.layout.etp == 1:
            return self.expert["ep"]
        return self.expert["ep", "etp"]

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"FoldedMesh(world_size={lay.world_size}, dense=tp{lay.tp}*cp{lay.cp}*dp{lay.dp}*pp{lay.pp}, "
            f"expert=etp{lay.etp}*ep{lay.ep}*edp{lay.edp}*pp{lay.pp})"
        )
