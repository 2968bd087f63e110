"""FoldedLayout: hand-worked groups, properties over many layouts, and every error message."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import random
from math import prod
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_moe.parallel import AXIS_NAMES, FoldedLayout
from lightning_moe.parallel import layout as layout_module

# ---- helpers -------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _orthogonal_groups(sizes: list[int], varying: list[bool]) -> list[list[int]]:
    """Independent spec of Megatron's masked orthogonal groups: sizes fastest first; group g,
    member m -> rank = sum of mixed-radix digits of (g over fixed axes, m over varying axes)."""
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    fixed = [i for i, v in enumerate(varying) if not v]
    moving = [i for i, v in enumerate(varying) if v]
    out = []
    for g_digits in itertools.product(*(range(sizes[i]) for i in reversed(fixed))):
        base = sum(d * strides[i] for d, i in zip(g_digits, reversed(fixed)))
        members = [
            base + sum(d * strides[i] for d, i in zip(m_digits, reversed(moving)))
            for m_digits in itertools.product(*(range(sizes[i]) for i in reversed(moving)))
        ]
        out.append(members)
    return out


def _reference_groups(layout: FoldedLayout, name: str) -> list[list[int]]:
    """Groups of ``name`` computed from the order string alone, the way Megatron's RankGenerator does."""
    tokens = layout.order.split("-")
    if name in ("tp", "cp", "pp", "dp", "dp_cp", "tp_cp"):
        dims = [t for t in tokens if t != "ep"]
        sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
        varying = set(name.split("_"))
    else:
        rename = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
        dims = [rename[t] for t in tokens if t != "cp"]
        sizes = {"etp": layout.etp, "ep": layout.ep, "edp": layout.edp, "pp": layout.pp}
        varying = {"tp_ep": {"etp", "ep"}}.get(name, {name})
    return _orthogonal_groups([sizes[d] for d in dims], [d in varying for d in dims])


def _mesh_groups(layout: FoldedLayout, kind: str, axis: str) -> list[list[int]]:
    """Groups along one axis of the mesh described by ``mesh_shape`` (as a DeviceMesh would form them)."""
    shape = layout.mesh_shape(kind)
    k = shape.names.index(axis)
    row_major = [prod(shape.sizes[i + 1 :]) for i in range(len(shape.sizes))]
    groups = []
    for idx in itertools.product(*(range(n) for n in shape.sizes)):
        if idx[k] == 0:
            flat = [sum(c * s for c, s in zip(idx[:k] + (j,) + idx[k + 1 :], row_major)) for j in range(shape.sizes[k])]
            groups.append([shape.ranks[f] for f in flat])
    return sorted(groups)


def _layouts() -> list[FoldedLayout]:
    """A deterministic sample of valid layouts, W from 1 to 1024, several orders, pp up to 4."""
    orders = ("tp-cp-ep-dp-pp", "tp-ep-cp-dp-pp", "cp-tp-dp-ep-pp", "dp-tp-cp-ep-pp", "pp-tp-cp-ep-dp")
    candidates = []
    for w in (1, 2, 6, 8, 12, 16, 24, 64, 128, 1024):
        for pp in (1, 2, 4):
            for tp, cp, etp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4)):
                if w % (tp * cp * pp) or w % (etp * pp):
                    continue
                for ep in _divisors(w // (etp * pp)):
                    for order in orders:
                        candidates.append((w, tp, cp, pp, ep, etp, order))
    rng = random.Random(0)
    picked = rng.sample(candidates, 80) + [(8, 2, 1, 1, 8, 1, orders[0]), (8, 2, 2, 1, 4, 1, orders[0])]
    out = []
    for w, tp, cp, pp, ep, etp, order in picked:
        out.append(FoldedLayout(w, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order))
    return out


LAYOUTS = _layouts()
LAYOUT_IDS = [f"W{l.world_size}-tp{l.tp}-cp{l.cp}-pp{l.pp}-ep{l.ep}-etp{l.etp}-{l.order}" for l in LAYOUTS]

# ---- hand-worked examples (rank pictures of parallel folding) --------------------------------------------------


def test_groups_match_worked_example_tp2_ep8() -> None:
    layout = FoldedLayout(8, tp=2, ep=8)
    assert (layout.dp, layout.edp) == (4, 1)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("ep") == [list(range(8))]
    assert layout.groups("edp") == [[r] for r in range(8)]
    assert layout.groups("cp") == [[r] for r in range(8)]
    assert layout.groups("tp_ep") == [list(range(8))]


def test_groups_match_worked_example_tp2_cp2_ep4() -> None:
    layout = FoldedLayout(8, tp=2, cp=2, ep=4)
    assert (layout.dp, layout.etp, layout.edp) == (2, 1, 2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("etp") == [[r] for r in range(8)]


def test_coords_of_rank_5_in_worked_example() -> None:
    layout = FoldedLayout(8, tp=2, cp=2, ep=4)
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0, "etp": 0, "ep": 1, "edp": 1}


def test_order_with_dp_before_cp_swaps_their_strides() -> None:
    layout = FoldedLayout(8, tp=2, cp=2, ep=2, etp=2, order="tp-dp-ep-cp-pp")
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # expert order: etp, edp, ep, pp -> etp stride 1, edp stride 2, ep stride 4
    assert layout.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.mesh_shape("dense").names == ("pp", "cp", "dp", "tp")
    assert layout.mesh_shape("expert").names == ("pp", "ep", "edp", "etp")


def test_mesh_shape_of_worked_example() -> None:
    layout = FoldedLayout(8, tp=2, cp=2, ep=4)
    dense, expert = layout.mesh_shape("dense"), layout.mesh_shape("expert")
    assert (dense.names, dense.sizes) == (("pp", "dp", "cp", "tp"), (1, 2, 2, 2))
    assert (expert.names, expert.sizes) == (("pp", "edp", "ep", "etp"), (1, 2, 4, 1))
    assert dense.ranks == expert.ranks == tuple(range(8))


def test_pipeline_groups_when_pp_is_last() -> None:
    layout = FoldedLayout(8, tp=2, pp=2, ep=4)
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_axis_names_and_public_exports() -> None:
    assert AXIS_NAMES == ("tp", "cp", "pp", "dp", "dp_cp", "tp_cp", "ep", "etp", "edp", "tp_ep")
    assert set(layout_module.__all__) >= {"FoldedLayout", "AXIS_NAMES", "MeshShape"}


def test_layout_is_frozen_and_hashable() -> None:
    layout = FoldedLayout(8, tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4  # type: ignore[misc]
    assert layout == FoldedLayout(world_size=8, tp=2) and hash(layout) == hash(FoldedLayout(8, tp=2))


def test_layout_module_imports_no_torch() -> None:
    tree = ast.parse(Path(layout_module.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] in ("torch", "lightning")]


# ---- properties over many layouts ----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_every_rank_in_exactly_one_group_of_the_right_size(layout: FoldedLayout) -> None:
    for name in AXIS_NAMES:
        groups = layout.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
        assert {len(g) for g in groups} == {layout.size(name)}, name
        assert len(groups) * layout.size(name) == layout.world_size
        assert all(g == sorted(g) for g in groups) and groups == sorted(groups)
    degrees = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep}
    degrees |= {"etp": layout.etp, "edp": layout.edp, "dp_cp": layout.dp * layout.cp}
    degrees |= {"tp_cp": layout.tp * layout.cp, "tp_ep": layout.etp * layout.ep}
    assert {n: layout.size(n) for n in AXIS_NAMES} == degrees


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_groups_match_megatron_style_reference(layout: FoldedLayout) -> None:
    for name in AXIS_NAMES:
        assert layout.groups(name) == _reference_groups(layout, name), name


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_group_of_agrees_with_groups(layout: FoldedLayout) -> None:
    w = layout.world_size
    ranks = sorted({0, w - 1, *random.Random(1).sample(range(w), min(16, w))})
    for name in AXIS_NAMES:
        by_rank = {r: g for g in layout.groups(name) for r in g}
        for r in ranks:
            assert layout.group_of(name, r) == by_rank[r], (name, r)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_group_members_differ_only_on_the_group_axes(layout: FoldedLayout) -> None:
    dense, expert = ("tp", "cp", "dp", "pp"), ("etp", "ep", "edp", "pp")
    varying = {"dp_cp": ("dp", "cp"), "tp_cp": ("tp", "cp"), "tp_ep": ("etp", "ep")}
    for name in AXIS_NAMES:
        axes = varying.get(name, (name,))
        fixed = [a for a in (dense if name in ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp") else expert) if a not in axes]
        for group in layout.groups(name)[:8]:
            coords = [layout.coords(r) for r in group]
            assert len({tuple(c[a] for a in fixed) for c in coords}) == 1, name
            assert len({tuple(c[a] for a in axes) for c in coords}) == len(group), name


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_pipeline_groups_identical_in_both_meshes(layout: FoldedLayout) -> None:
    assert _mesh_groups(layout, "dense", "pp") == _mesh_groups(layout, "expert", "pp") == layout.groups("pp")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_mesh_shape_axes_reproduce_groups(layout: FoldedLayout) -> None:
    for kind, axes in (("dense", ("pp", "dp", "cp", "tp")), ("expert", ("pp", "edp", "ep", "etp"))):
        shape = layout.mesh_shape(kind)
        assert sorted(shape.names) == sorted(axes)
        assert prod(shape.sizes) == layout.world_size and sorted(shape.ranks) == list(range(layout.world_size))
        for axis in axes:
            assert _mesh_groups(layout, kind, axis) == layout.groups(axis), (kind, axis)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_combined_groups_are_unions_of_their_single_axes(layout: FoldedLayout) -> None:
    for name, outer, inner in (("dp_cp", "cp", "dp"), ("tp_cp", "tp", "cp"), ("tp_ep", "ep", "etp")):
        for group in layout.groups(name)[:8]:
            r = group[0]
            union = sorted({m for o in layout.group_of(outer, r) for m in layout.group_of(inner, o)})
            assert group == union, name


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_coords_rebuild_the_rank_from_order_strides(layout: FoldedLayout) -> None:
    tokens = layout.order.split("-")
    dense = [(t, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}[t]) for t in tokens if t != "ep"]
    rename = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    expert = [(rename[t], getattr(layout, rename[t])) for t in tokens if t != "cp"]
    for r in range(0, layout.world_size, max(1, layout.world_size // 64)):
        c = layout.coords(r)
        for factors in (dense, expert):
            strides = [prod(n for _, n in factors[:i]) for i in range(len(factors))]
            assert sum(c[a] * s for (a, _), s in zip(factors, strides)) == r


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": 8, "tp": 0}, "tp=0"),
        ({"world_size": 8, "ep": -2}, "ep=-2"),
        ({"world_size": 8, "cp": 1.5}, "cp=1.5"),
        ({"world_size": 8, "etp": True}, "etp=True"),
        ({"world_size": 8, "pp": "2"}, "pp='2'"),
    ],
)
def test_non_positive_or_non_int_degree_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=f"FoldedLayout: {match} must be a positive int"):
        FoldedLayout(**kwargs)


def test_dense_degrees_not_dividing_world_raises_with_choices() -> None:
    with pytest.raises(ValueError, match=r"tp\*cp\*pp=6 \(tp=3, cp=2, pp=1\) must divide world_size=8") as err:
        FoldedLayout(8, tp=3, cp=2)
    assert "[1, 2, 4, 8]" in str(err.value)


def test_expert_degrees_not_dividing_world_raises_with_choices() -> None:
    with pytest.raises(ValueError, match=r"etp\*ep\*pp=12 \(etp=4, ep=3, pp=1\) must divide world_size=16"):
        FoldedLayout(16, ep=3, etp=4)


@pytest.mark.parametrize(
    ("order", "match"),
    [
        ("tp-cp-xp-dp-pp", "unknown token 'xp'"),
        ("tp-tp-ep-dp-pp", "repeats 'tp'"),
        ("tp-cp-ep-dp", "lacks 'pp'"),
        ("", "lacks 'tp', 'cp', 'ep', 'dp', 'pp'"),
    ],
)
def test_bad_order_string_names_the_wrong_token(order: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FoldedLayout(8, order=order)


def test_non_string_order_raises() -> None:
    with pytest.raises(ValueError, match=r"order=\('tp', 'dp'\) must be a str"):
        FoldedLayout(8, order=("tp", "dp"))  # type: ignore[arg-type]


def test_pipeline_parallel_degree_takes_its_share_of_both_factorizations() -> None:
    layout = FoldedLayout(16, tp=2, pp=4, ep=2)
    assert (layout.dp, layout.edp, layout.size("pp")) == (2, 2, 4)
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_order_giving_different_pipeline_groups_raises() -> None:
    with pytest.raises(ValueError, match="order='tp-pp-cp-ep-dp' puts pp at stride 2 for attention and 1"):
        FoldedLayout(8, tp=2, pp=2, order="tp-pp-cp-ep-dp")


def test_check_experts_rejects_ep_not_dividing_num_experts() -> None:
    layout = FoldedLayout(8, ep=8)
    with pytest.raises(ValueError, match=r"ep=8 must divide num_experts=60; choose ep from \[1, 2, 4\]"):
        layout.check_experts(num_experts=60, ffn_hidden_size=128)
    layout.check_experts(num_experts=64, ffn_hidden_size=128)


def test_check_experts_rejects_etp_not_dividing_ffn_hidden_size() -> None:
    layout = FoldedLayout(8, ep=2, etp=4)
    with pytest.raises(ValueError, match=r"etp=4 must divide ffn_hidden_size=6; choose etp from \[1, 2\]"):
        layout.check_experts(num_experts=8, ffn_hidden_size=6)


def test_check_experts_rejects_non_positive_counts() -> None:
    with pytest.raises(ValueError, match="num_experts=0"):
        FoldedLayout(8).check_experts(num_experts=0, ffn_hidden_size=8)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda l: l.groups("xp"), "name='xp' is not an axis name"),
        (lambda l: l.group_of("dp", 8), "rank=8 must be an int in"),
        (lambda l: l.coords(-1), "rank=-1 must be an int in"),
        (lambda l: l.mesh_shape("sparse"), "kind='sparse' is not a mesh kind"),
        (lambda l: l.size("ep_dp"), "name='ep_dp' is not an axis name"),
    ],
)
def test_bad_query_raises(call: Callable[[FoldedLayout], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(FoldedLayout(8, tp=2, ep=4))


def test_check_experts_suggests_etp_that_divides_the_ranks_left_per_expert_replica() -> None:
    # W=16, ep=2: an etp must divide ffn_hidden_size=12 and W / ep = 8 -> [1, 2, 4] (not W / etp = 2).
    layout = FoldedLayout(16, ep=2, etp=8)
    with pytest.raises(ValueError, match=r"etp=8 must divide ffn_hidden_size=12; choose etp from \[1, 2, 4\]"):
        layout.check_experts(num_experts=8, ffn_hidden_size=12)
