"""FoldedLayout with pipeline parallel: every group equals Megatron-Core's RankGenerator.

The reference below restates how Megatron-Core forms its groups, independently of
``FoldedLayout``'s code. Two rank generators read the same order string: the dense one with
sizes ``tp cp ep=1 dp pp`` and the expert one with ``tp=etp cp=1 ep dp=edp pp`` (size-1 dimensions
stay in the order; they change nothing). A generator lists the order's sizes fastest-varying
first, each with the stride ``prod(sizes before it)``. For a set of group dimensions (the mask),
group ``g`` and member ``m`` are two mixed-radix numbers: ``g``'s digits run over the *other*
dimensions, ``m``'s over the group's, both fastest dimension first, and the rank is the sum of
every digit times its dimension's stride. The embedding group of a pipeline group is its first and
last rank (one rank when the group has one).

Over >= 300 random layouts with ``pp`` in {2, 4, 8} and up to 1024 ranks, with ``pp`` last, first
or (where the strides happen to agree) in between, no group differs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from math import prod

import pytest
import torch.distributed as dist

from lightning_moe.parallel.layout import AXIS_NAMES, FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh

# FoldedLayout axis -> (generator, the order tokens that vary inside one group)
_MEGATRON_TOKENS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "pp": ("dense", ("pp",)),
    "dp": ("dense", ("dp",)),
    "dp_cp": ("dense", ("dp", "cp")),
    "tp_cp": ("dense", ("tp", "cp")),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),
    "tp_ep": ("expert", ("tp", "ep")),
}


def _digits(number: int, radices: list[int]) -> list[int]:
    """``number`` as mixed-radix digits, the first radix fastest."""
    out = []
    for radix in radices:
        out.append(number % radix)
        number //= radix
    return out


def _masked_groups(world: int, sizes: list[int], in_group: list[bool]) -> list[list[int]]:
    """Megatron's masked orthogonal groups: sizes in order (fastest first), ``in_group`` the mask."""
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    inner = [(n, s) for n, s, m in zip(sizes, strides, in_group) if m]
    outer = [(n, s) for n, s, m in zip(sizes, strides, in_group) if not m]
    group_size = prod(n for n, _ in inner)
    groups = []
    for g in range(world // group_size):
        base = sum(d * s for d, (_, s) in zip(_digits(g, [n for n, _ in outer]), outer))
        groups.append(
            [base + sum(d * s for d, (_, s) in zip(_digits(m, [n for n, _ in inner]), inner)) for m in range(group_size)]
        )
    return groups


def _generator_groups(layout: FoldedLayout, generator: str, tokens: tuple[str, ...]) -> list[list[int]]:
    """``RankGenerator(...).get_ranks('-'.join(tokens))`` of the dense or the expert generator."""
    if generator == "dense":
        sizes = {"tp": layout.tp, "cp": layout.cp, "ep": 1, "dp": layout.dp, "pp": layout.pp}
    else:
        sizes = {"tp": layout.etp, "cp": 1, "ep": layout.ep, "dp": layout.edp, "pp": layout.pp}
    order = layout.order.split("-")
    return _masked_groups(layout.world_size, [sizes[t] for t in order], [t in tokens for t in order])


def _embedding_ranks(pp_group: list[int]) -> list[int]:
    return [pp_group[0]] if len(pp_group) == 1 else [pp_group[0], pp_group[-1]]


def _mismatches(layout: FoldedLayout) -> list[str]:
    """Every group of ``layout`` that differs from the Megatron-style reference, by name."""
    bad = [name for name in AXIS_NAMES if layout.groups(name) != _generator_groups(layout, *_MEGATRON_TOKENS[name])]
    if _generator_groups(layout, "expert", ("pp",)) != layout.groups("pp"):
        bad.append("pp (expert generator)")
    reference_pp = _generator_groups(layout, "dense", ("pp",))
    if layout.embedding_groups() != [_embedding_ranks(g) for g in reference_pp]:
        bad.append("embedding")
    return bad


def _random_layouts(count: int, seed: int) -> list[FoldedLayout]:
    """``count`` distinct valid layouts with pp in {2, 4, 8}, W up to 1024; pp last, first or between."""
    rng = random.Random(seed)
    worlds = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    seen: set[FoldedLayout] = set()
    while len(seen) < count:
        w = rng.choice(worlds)
        pp = rng.choice([p for p in (2, 4, 8) if w % p == 0])
        tp = rng.choice([d for d in (1, 2, 4, 8) if (w // pp) % d == 0])
        cp = rng.choice([d for d in (1, 2, 4) if (w // (pp * tp)) % d == 0])
        etp = rng.choice([d for d in (1, 2, 4) if (w // pp) % d == 0])
        ep = rng.choice([d for d in range(1, w // (pp * etp) + 1) if (w // (pp * etp)) % d == 0])
        rest = ["tp", "cp", "ep", "dp"]
        rng.shuffle(rest)
        where = rng.choice(("last", "first", "between"))
        order = {"last": rest + ["pp"], "first": ["pp"] + rest}.get(where)
        if order is None:
            at = rng.randrange(1, 4)
            order = rest[:at] + ["pp"] + rest[at:]
        try:
            seen.add(FoldedLayout(w, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order="-".join(order)))
        except ValueError as err:  # pp between dimensions whose strides differ in the two factorizations
            if "puts pp at stride" not in str(err):
                raise
    return sorted(seen, key=lambda l: (l.world_size, l.pp, l.tp, l.cp, l.ep, l.etp, l.order))


LAYOUTS = _random_layouts(320, seed=7)


def test_sample_covers_every_pipeline_degree_and_placement() -> None:
    assert len(LAYOUTS) >= 300
    assert {l.pp for l in LAYOUTS} == {2, 4, 8}
    assert max(l.world_size for l in LAYOUTS) == 1024
    placements = {"last" if l.order.endswith("pp") else "first" if l.order.startswith("pp") else "between" for l in LAYOUTS}
    assert placements == {"last", "first", "between"}


def test_every_group_equals_megatron_rank_generator_over_random_pipeline_layouts() -> None:
    bad = {f"W{l.world_size}-tp{l.tp}-cp{l.cp}-pp{l.pp}-ep{l.ep}-etp{l.etp}-{l.order}": _mismatches(l) for l in LAYOUTS}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{len(bad)} of {len(LAYOUTS)} layouts differ from the reference: {dict(list(bad.items())[:5])}"


def test_layout_refuses_exactly_the_orders_whose_two_generators_give_different_pp_groups() -> None:
    rng = random.Random(11)
    accepted = refused = 0
    for _ in range(200):
        tokens = ["tp", "cp", "ep", "dp", "pp"]
        rng.shuffle(tokens)
        w, pp = 64, rng.choice((2, 4))
        tp, cp, ep, etp = rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2, 4)), rng.choice((1, 2))
        args = dict(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order="-".join(tokens))
        probe = FoldedLayout(w, **(args | {"pp": 1}))  # the same sizes without the pipeline rule
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": probe.dp // pp, "pp": pp}
        expert = {"tp": etp, "cp": 1, "ep": ep, "dp": probe.edp // pp, "pp": pp}
        same = _masked_groups(w, [dense[t] for t in tokens], [t == "pp" for t in tokens]) == _masked_groups(
            w, [expert[t] for t in tokens], [t == "pp" for t in tokens]
        )
        if same:
            FoldedLayout(w, **args)
            accepted += 1
        else:
            with pytest.raises(ValueError, match="so their pipeline groups differ; put pp last"):
                FoldedLayout(w, **args)
            refused += 1
    assert accepted and refused


def test_embedding_groups_are_the_first_and_last_stage_of_each_pipeline() -> None:
    layout = FoldedLayout(16, tp=2, pp=4, ep=4)
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert layout.embedding_group_of(13) == [1, 13] and layout.embedding_group_of(5) is None
    assert FoldedLayout(4, ep=2).embedding_groups() == [[0], [1], [2], [3]]
    assert FoldedLayout(4, ep=2).embedding_group_of(2) == [2]


def test_pipeline_first_order_puts_stages_on_neighbouring_ranks() -> None:
    layout = FoldedLayout(8, tp=2, pp=2, ep=2, order="pp-tp-cp-ep-dp")
    assert layout.groups("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [layout.coords(r)["pp"] for r in range(8)] == [0, 1] * 4


@pytest.mark.parametrize(
    "layout",
    [FoldedLayout(16, tp=2, pp=2, ep=4), FoldedLayout(16, cp=2, pp=4, ep=2, etp=2, order="pp-tp-cp-ep-dp")],
    ids=["pp-last", "pp-first"],
)
def test_both_device_meshes_carry_the_same_pipeline_groups_on_every_rank(
    layout: FoldedLayout, fake_world: Callable[[int, int], None]
) -> None:
    for rank in range(layout.world_size):
        fake_world(rank, layout.world_size)
        mesh = FoldedMesh.build(layout, "cpu")
        want = layout.group_of("pp", rank)
        assert dist.get_process_group_ranks(mesh.dense["pp"].get_group()) == want
        assert dist.get_process_group_ranks(mesh.expert["pp"].get_group()) == want
        assert dist.get_process_group_ranks(mesh.group("pp")) == want
        assert mesh.rank("pp") == layout.coords(rank)["pp"] == want.index(rank)
