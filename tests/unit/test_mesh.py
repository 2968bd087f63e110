"""FoldedMesh: the DeviceMesh groups equal FoldedLayout's, for 64+ ranks in one process.

The ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) lets one process act as
any rank of any world size: ``DeviceMesh`` and ``new_group`` run their real bookkeeping and no
data moves. Each case is built once per rank, so every rank's groups are checked, not only
rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist

from lightning_moe.parallel.layout import AXIS_NAMES, FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh

pytest.importorskip("torch.testing._internal.distributed.fake_pg")


class _PipelineLayout(FoldedLayout):
    """FoldedLayout with the 'pp comes later' rule lifted: the mesh must already handle pp."""

    def _check_pipeline_supported(self) -> None:
        pass


def _ranks(world: int) -> list[int]:
    """Every rank up to 128; beyond that the first, last and a spread of ranks in between."""
    if world <= 128:
        return list(range(world))
    return sorted({0, 1, world // 3, world // 2 + 1, world - 2, world - 1})


def _group_ranks(mesh: FoldedMesh, name: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.group(name))


def _case_id(layout: FoldedLayout) -> str:
    lay = layout
    return f"W{lay.world_size}-tp{lay.tp}-cp{lay.cp}-pp{lay.pp}-ep{lay.ep}-etp{lay.etp}-{lay.order}"


CASES = [
    FoldedLayout(64, ep=64),  # DP64 attention, EP64 experts
    FoldedLayout(64, tp=2, ep=8, etp=2),  # TP2·DP32, ETP2·EP8·EDP4
    FoldedLayout(64, tp=4, cp=2, ep=4),  # TP4·CP2·DP8, EP4·EDP16 (CP only in the dense view)
    FoldedLayout(96, tp=2, ep=6, order="tp-ep-cp-dp-pp"),  # EP before CP in the order string
    _PipelineLayout(128, tp=2, cp=2, pp=4, ep=4, etp=2),  # pp shared by both views
    FoldedLayout(1024, tp=8, ep=64, etp=2),  # sampled ranks
]


@pytest.mark.parametrize("layout", CASES, ids=_case_id)
def test_dense_and_expert_mesh_groups_equal_folded_layout_groups_on_every_rank(
    layout: FoldedLayout, fake_world: Callable[[int, int], None]
) -> None:
    world = layout.world_size
    for rank in _ranks(world):
        fake_world(rank, world)
        mesh = FoldedMesh.build(layout, "cpu")
        for name in AXIS_NAMES:
            want = layout.group_of(name, rank)
            assert mesh.mesh(name).size() == len(want), (rank, name)
            assert mesh.mesh(name).mesh.flatten().tolist() == want, (rank, name)
            assert _group_ranks(mesh, name) == want, (rank, name)
            assert mesh.rank(name) == want.index(rank), (rank, name)
        coords = layout.coords(rank)
        for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            assert mesh.rank(axis) == coords[axis], (rank, axis)


@pytest.mark.parametrize("layout", CASES, ids=_case_id)
def test_mesh_axes_follow_the_order_string_slowest_first(
    layout: FoldedLayout, fake_world: Callable[[int, int], None]
) -> None:
    fake_world(0, layout.world_size)
    mesh = FoldedMesh.build(layout, "cpu")
    for kind, device_mesh in (("dense", mesh.dense), ("expert", mesh.expert)):
        shape = layout.mesh_shape(kind)
        assert device_mesh.mesh_dim_names == shape.names
        assert tuple(device_mesh.mesh.shape) == shape.sizes
        assert device_mesh.mesh.flatten().tolist() == list(range(layout.world_size))
    want = ("ep",) if layout.etp == 1 else ("ep", "etp")
    assert mesh.expert_shard_mesh.mesh_dim_names == want


def test_unknown_axis_name_is_rejected_with_the_valid_names(fake_world: Callable[[int, int], None]) -> None:
    layout = FoldedLayout(64, tp=2, ep=8)
    fake_world(5, 64)
    mesh = FoldedMesh.build(layout, "cpu")
    with pytest.raises(ValueError, match=r"name='expert' is not an axis name; use one of \('tp', 'cp'"):
        mesh.mesh("expert")
