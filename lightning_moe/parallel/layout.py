"""Rank algebra of parallel folding: one world of W ranks, cut two ways.

MoE parallel folding (Megatron-Core) factors the same world twice:

* dense (attention, embeddings, norms): ``tp x cp x dp x pp``, with ``dp = W / (tp*cp*pp)``
* expert (the routed experts):          ``etp x ep x edp x pp``, with ``edp = W / (etp*ep*pp)``

The ``order`` string (default ``"tp-cp-ep-dp-pp"``) lists the dimensions fastest-varying first.
The dense factorization reads it with ``ep`` dropped (tp, cp, dp, pp); the expert one reads it
with ``cp`` dropped, ``tp`` as ``etp`` and ``dp`` as ``edp`` (etp, ep, edp, pp). Within one
factorization a rank is a mixed-radix number::

    rank = sum_i coord_i * stride_i        stride_i = prod_{j < i} size_j

The group of a set of axes M holds the ranks that differ only in M's coordinates. Ranks inside
a group, and groups by their first rank, are listed in increasing order. This is the ordering of
Megatron-Core's ``RankGenerator`` for the same order string, so users moving from Megatron get
the same groups.

Worked example, W=8, tp=2, cp=2, ep=4, default order (so dp=2, etp=1, edp=2)::

    dense   strides tp:1 cp:2 dp:4         expert  strides etp:1 ep:1 edp:4
    tp  [0,1] [2,3] [4,5] [6,7]            ep   [0,1,2,3] [4,5,6,7]
    cp  [0,2] [1,3] [4,6] [5,7]            edp  [0,4] [1,5] [2,6] [3,7]
    dp  [0,4] [1,5] [2,6] [3,7]            etp  [0] [1] ... [7]

Rank 5 sits at tp=1, cp=0, dp=1 for attention and at etp=0, ep=1, edp=1 for the experts.

Axis names (``AXIS_NAMES``, the only spelling used in the package): single axes ``tp cp pp dp``
(dense), ``ep etp edp`` (expert); combined axes ``dp_cp`` and ``tp_cp`` (dense) and ``tp_ep``
(expert: etp x ep, Megatron's expert tensor-and-model-parallel group). ``pp`` is shared: both
factorizations must give the same pipeline groups, which holds when pp sits at the same stride
in both (pp last, the default, or pp first).

Pipeline stages: a rank's stage is its ``pp`` coordinate. The embedding groups
(:meth:`FoldedLayout.embedding_groups`) hold the first and the last stage of each pp group, the
ranks that hold the input embedding and the output head (one rank when ``pp == 1``), as
Megatron-Core's default embedding ranks; they carry the gradient of tied embeddings.

CP never appears in the expert factorization, so "EP with CP in one factorization" cannot
happen: experts fold EP over the ranks that attention spends on TP, CP and DP.

Nothing here imports torch; ``parallel/mesh.py`` builds DeviceMeshes from :meth:`FoldedLayout.mesh_shape`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from math import prod
from types import MappingProxyType
from typing import Literal

__all__ = ["AXIS_NAMES", "ORDER_TOKENS", "FoldedLayout", "MeshKind", "MeshShape"]

MeshKind = Literal["dense", "expert"]

AXIS_NAMES: tuple[str, ...] = ("tp", "cp", "pp", "dp", "dp_cp", "tp_cp", "ep", "etp", "edp", "tp_ep")
ORDER_TOKENS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")

# axis name -> (factorization, the single axes whose coordinates vary inside one group)
_AXES: MappingProxyType[str, tuple[MeshKind, tuple[str, ...]]] = MappingProxyType(
    {
        "tp": ("dense", ("tp",)),
        "cp": ("dense", ("cp",)),
        "pp": ("dense", ("pp",)),
        "dp": ("dense", ("dp",)),
        "dp_cp": ("dense", ("cp", "dp")),
        "tp_cp": ("dense", ("tp", "cp")),
        "ep": ("expert", ("ep",)),
        "etp": ("expert", ("etp",)),
        "edp": ("expert", ("edp",)),
        "tp_ep": ("expert", ("etp", "ep")),
    }
)
# how each order token is read in the expert factorization (None: absent there)
_EXPERT_NAME: MappingProxyType[str, str | None] = MappingProxyType(
    {"tp": "etp", "cp": None, "ep": "ep", "dp": "edp", "pp": "pp"}
)


def _divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class MeshShape:
    """What a DeviceMesh needs: axis names and sizes (slowest first) and the rank layout.

    ``ranks`` is flat in row-major order over ``sizes``; a mesh is
    ``DeviceMesh(device_type, torch.tensor(ranks).reshape(sizes), mesh_dim_names=names)``. Because
    strides are prefix products in the order string, ``ranks`` is always ``0..W-1``: the order
    only decides which name sits on which mesh axis.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class FoldedLayout:
    """The dense and expert factorizations of one world, with every group they define.

    Args:
        world_size: number of ranks W.
        tp: tensor-parallel degree of the dense layers.
        cp: context-parallel degree of attention.
        pp: pipeline-parallel degree, shared by both factorizations (the same pp groups in each).
        ep: expert-parallel degree.
        etp: tensor-parallel degree inside each expert.
        order: dimensions ``tp cp ep dp pp`` joined by ``-``, fastest-varying first.

    Every rule is checked at construction and reported as ``FoldedLayout: field=value breaks
    rule; fix.`` (``ValueError``). Rules that need the model are in :meth:`check_experts`.
    """

    world_size: int
    _: KW_ONLY
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "cp", "pp", "ep", "etp"):
            _check_positive_int(name, getattr(self, name))
        self._check_order()
        w = self.world_size
        for label, degrees in (("tp*cp*pp", ("tp", "cp", "pp")), ("etp*ep*pp", ("etp", "ep", "pp"))):
            size = prod(getattr(self, d) for d in degrees)
            if w % size:
                values = ", ".join(f"{d}={getattr(self, d)}" for d in degrees)
                raise ValueError(
                    f"FoldedLayout: {label}={size} ({values}) must divide world_size={w}; "
                    f"choose {label} from {_divisors(w)}."
                )
        self._check_pipeline_strides()

    def _check_order(self) -> None:
        valid = "-".join(ORDER_TOKENS)
        if not isinstance(self.order, str):
            raise ValueError(f"FoldedLayout: order={self.order!r} must be a str; pass e.g. order={valid!r}.")
        tokens = self.order.split("-") if self.order else []
        for tok in tokens:
            if tok not in ORDER_TOKENS:
                raise ValueError(
                    f"FoldedLayout: order={self.order!r} has unknown token {tok!r}; "
                    f"use each of {valid} once, e.g. order={valid!r}."
                )
            if tokens.count(tok) > 1:
                raise ValueError(
                    f"FoldedLayout: order={self.order!r} repeats {tok!r}; use each of {valid} once."
                )
        missing = [tok for tok in ORDER_TOKENS if tok not in tokens]
        if missing:
            raise ValueError(
                f"FoldedLayout: order={self.order!r} lacks {', '.join(map(repr, missing))}; "
                f"use each of {valid} once."
            )

    def _check_pipeline_strides(self) -> None:
        # Both factorizations must agree on pp groups: pp needs the same stride in each.
        if self.pp == 1:
            return
        dense, expert = self._stride("dense", "pp"), self._stride("expert", "pp")
        if dense != expert:
            raise ValueError(
                f"FoldedLayout: order={self.order!r} puts pp at stride {dense} for attention and "
                f"{expert} for experts, so their pipeline groups differ; put pp last (or first) in order."
            )

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel degree of the dense layers, ``W / (tp*cp*pp)``."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Data-parallel degree of the experts, ``W / (etp*ep*pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, name: str) -> int:
        """Number of ranks in each group of axis ``name`` (one of ``AXIS_NAMES``)."""
        kind, axes = self._axis(name)
        sizes = dict(self._factors(kind))
        return prod(sizes[a] for a in axes)

    # ---- factorizations ------------------------------------------------------------------------

    def _factors(self, kind: MeshKind) -> list[tuple[str, int]]:
        """``(axis, size)`` of one factorization, fastest-varying first."""
        if kind == "dense":
            sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
            return [(tok, sizes[tok]) for tok in self.order.split("-") if tok != "ep"]
        sizes = {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}
        names = (_EXPERT_NAME[tok] for tok in self.order.split("-"))
        return [(n, sizes[n]) for n in names if n is not None]

    def _strides(self, kind: MeshKind) -> dict[str, tuple[int, int]]:
        """``axis -> (stride, size)`` of one factorization."""
        out, stride = {}, 1
        for axis, size in self._factors(kind):
            out[axis] = (stride, size)
            stride *= size
        return out

    def _stride(self, kind: MeshKind, axis: str) -> int:
        return self._strides(kind)[axis][0]

    def _axis(self, name: str) -> tuple[MeshKind, tuple[str, ...]]:
        if name not in _AXES:
            raise ValueError(f"FoldedLayout: name={name!r} is not an axis name; use one of {AXIS_NAMES}.")
        return _AXES[name]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"FoldedLayout: rank={rank!r} must be an int in [0, {self.world_size}); pass a rank of this world."
            )

    # ---- queries -------------------------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on every single axis: tp, cp, dp, pp (dense) and etp, ep, edp (expert)."""
        self._check_rank(rank)
        dense = {a: (rank // s) % n for a, (s, n) in self._strides("dense").items()}
        expert = {a: (rank // s) % n for a, (s, n) in self._strides("expert").items()}
        assert dense["pp"] == expert["pp"], "pp coordinate differs between factorizations"
        return {a: dense[a] for a in ("tp", "cp", "dp", "pp")} | {a: expert[a] for a in ("etp", "ep", "edp")}

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of axis ``name`` that holds ``rank``, in increasing rank order."""
        kind, axes = self._axis(name)
        self._check_rank(rank)
        strides = self._strides(kind)
        # Zero the varying coordinates, then enumerate them fastest axis first: the result is sorted.
        base = rank - sum(((rank // strides[a][0]) % strides[a][1]) * strides[a][0] for a in axes)
        members = [base]
        for axis in sorted(axes, key=lambda a: strides[a][0]):
            stride, size = strides[axis]
            members = [m + c * stride for c in range(size) for m in members]
        return members

    def groups(self, name: str) -> list[list[int]]:
        """All groups of axis ``name``, each in increasing rank order, ordered by first rank."""
        kind, axes = self._axis(name)
        strides = self._strides(kind)
        # A group's first rank is the one whose varying coordinates are all zero.
        return [
            self.group_of(name, r)
            for r in range(self.world_size)
            if all((r // strides[a][0]) % strides[a][1] == 0 for a in axes)
        ]

    def embedding_groups(self) -> list[list[int]]:
        """First and last rank of every pp group (the stages holding the embedding and the head),
        ordered as :meth:`groups` orders the pp groups; a single rank per group when ``pp == 1``."""
        return [_first_and_last(group) for group in self.groups("pp")]

    def embedding_group_of(self, rank: int) -> list[int] | None:
        """The embedding group holding ``rank``, or ``None`` for a rank on a middle pipeline stage."""
        group = _first_and_last(self.group_of("pp", rank))
        return group if rank in group else None

    def mesh_shape(self, kind: MeshKind) -> MeshShape:
        """Names, sizes and rank layout of the ``"dense"`` (pp, dp, cp, tp) or ``"expert"``
        (pp, edp, ep, etp) DeviceMesh, axes slowest-varying first as the order string implies.
        Size-1 axes are kept, so every name of the factorization can be sliced from the mesh.
        """
        if kind not in ("dense", "expert"):
            raise ValueError(f"FoldedLayout: kind={kind!r} is not a mesh kind; use 'dense' or 'expert'.")
        factors = self._factors(kind)[::-1]
        return MeshShape(
            names=tuple(a for a, _ in factors),
            sizes=tuple(n for _, n in factors),
            ranks=tuple(range(self.world_size)),
        )

    def check_experts(self, num_experts: int, ffn_hidden_size: int) -> None:
        """Check the rules that need the model: ``ep | num_experts`` and ``etp | ffn_hidden_size``.

        The suggested choices also keep ``etp*ep*pp`` a divisor of the world size.
        """
        _check_positive_int("num_experts", num_experts)
        _check_positive_int("ffn_hidden_size", ffn_hidden_size)
        w_pp = self.world_size // self.pp
        if num_experts % self.ep:
            choices = [d for d in _divisors(num_experts) if (w_pp // self.etp) % d == 0]
            raise ValueError(
                f"FoldedLayout: ep={self.ep} must divide num_experts={num_experts}; choose ep from {choices}."
            )
        if ffn_hidden_size % self.etp:
            choices = [d for d in _divisors(ffn_hidden_size) if (w_pp // self.ep) % d == 0]
            raise ValueError(
                f"FoldedLayout: etp={self.etp} must divide ffn_hidden_size={ffn_hidden_size}; "
                f"choose etp from {choices}."
            )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"FoldedLayout: {name}={value!r} must be a positive int; set it to 1 or more.")


def _first_and_last(group: list[int]) -> list[int]:
    return group[:1] if len(group) == 1 else [group[0], group[-1]]
