"""Layout and meshes of a folded strategy, as plain functions.

1. constructor-time checks that need no world size (:func:`check_args`, :func:`check_parallel_options`,
   :func:`check_namespace`; the pipeline options: ``strategies/pipeline_setup.py``);
2. :func:`folded_layout`: the :class:`FoldedLayout` for a world size, ``dp``/``edp`` checked, before
   any collective;
3. views of a built :class:`FoldedMesh` that a training loop reads: :func:`context_parallel_of`
   (the CP group, size, rank), :func:`loss_group_of` (``dp_cp`` and its size),
   :func:`expert_bias_group_of` (the ranks that route different tokens) and
   :func:`sampler_kwargs_of` (DP rank and size).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_moe.checks import check_bool
from lightning_moe.parallel.fold_batch import ContextParallel
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import check_dispatcher

__all__ = [
    "Degree",
    "check_args",
    "check_namespace",
    "check_parallel_options",
    "context_parallel_of",
    "expert_bias_group_of",
    "folded_layout",
    "loss_group_of",
    "sampler_kwargs_of",
]

Degree = Literal["auto"] | int


def check_namespace(obj: Any, owner: str) -> None:
    """Raise if ``obj`` comes from the ``pytorch_lightning`` package (separate registries/classes)."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "pytorch_lightning":
            raise TypeError(
                f"{owner}: got {cls.__module__}.{cls.__name__} from the `pytorch_lightning` namespace; lightning-moe "
                "supports the `lightning` namespace only: use `import lightning.pytorch as pl` (and `lightning.Fabric`)."
            )


def check_args(
    owner: str, tp: int, cp: int, ep: int, etp: int, pp: int, dp: Degree, edp: Degree, order: str, dispatcher: str
) -> None:
    """Checks that need no world size (constructor time)."""
    check_dispatcher(dispatcher, owner)
    for name, value in (("dp", dp), ("edp", edp)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name}={value!r} must be 'auto' or a positive int.")
    # Order tokens and positive degrees are checked by FoldedLayout with a world that always divides.
    world = tp * cp * ep * etp * pp if all(isinstance(d, int) and d > 0 for d in (tp, cp, ep, etp, pp)) else 1
    FoldedLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)


def check_parallel_options(owner: str, tp: int, sequence_parallel: Any, vocab_parallel: Any) -> None:
    """``sequence_parallel`` and ``vocab_parallel`` are bools and act on a TP group: both need ``tp > 1``."""
    for name, value in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel)):
        check_bool(owner, name, value)
        if value and tp == 1:
            raise ValueError(
                f"{owner}: {name}=True needs tensor parallel (it splits over the TP group) but tp=1; "
                f"set tp>1 or {name}=False."
            )


def folded_layout(
    owner: str, world_size: int, tp: int, cp: int, ep: int, etp: int, pp: int, dp: Degree, edp: Degree, order: str
) -> FoldedLayout:
    """The layout for ``world_size`` ranks; raises ``ValueError`` before any collective."""
    layout = FoldedLayout(world_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    if dp != "auto" and dp != layout.dp:
        raise ValueError(
            f"{owner}: dp={dp} but world_size={world_size} / (tp={tp} * cp={cp} * pp={pp}) = {layout.dp}; "
            f"set dp='auto' or dp={layout.dp}."
        )
    if edp != "auto" and edp != layout.edp:
        raise ValueError(
            f"{owner}: edp={edp} but world_size={world_size} / (etp={etp} * ep={ep} * pp={pp}) = {layout.edp}; "
            f"set edp='auto' or edp={layout.edp}."
        )
    return layout


def context_parallel_of(mesh: FoldedMesh) -> ContextParallel:
    """The CP group (``None`` at ``cp=1``), its size and this rank's coordinate in it."""
    if mesh.layout.cp == 1:
        return ContextParallel(None, 1, 0)
    return ContextParallel(mesh.group("cp"), mesh.layout.cp, mesh.rank("cp"))


def loss_group_of(mesh: FoldedMesh) -> tuple[Any, int]:
    """The ranks whose labelled tokens make up one micro-batch of the step (``dp_cp``) and their
    number; ``(None, 1)`` with one data rank."""
    lay = mesh.layout
    if lay.dp * lay.cp == 1:
        return None, 1
    return mesh.group("dp_cp"), lay.dp * lay.cp


def expert_bias_group_of(mesh: FoldedMesh, sequence_parallel: bool) -> Any:
    """The group the router's token counts are summed over: the ranks that route different tokens.

    DP x CP (``dp_cp``); with ``sequence_parallel`` every TP rank routes its own sequence shard
    too, so the whole world (``pp=1``). ``None`` when every rank routes the same tokens.
    """
    lay = mesh.layout
    if sequence_parallel and lay.tp > 1:
        return torch.distributed.group.WORLD
    return mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None


def sampler_kwargs_of(mesh: FoldedMesh) -> dict[str, Any]:
    """DP rank and size: tensor/context-parallel ranks of one DP rank read the same batch."""
    return {"num_replicas": mesh.layout.dp, "rank": mesh.rank("dp")}
