"""Pipeline parallel plan: which layers each stage runs, where stages sit, and the input checks.

Legend: ``pp`` ranks in a pipeline group, ``v`` virtual stages per rank, ``S = pp * v`` stages.

Stages of a plan (plain functions, no process group, no torch):

1. :func:`split_layers`: the model's ``num_layers`` blocks cut into ``S`` contiguous ranges, stage 0
   first. Without ``weights`` the split is even and ``S`` must divide ``num_layers``. With
   ``weights`` (one cost per block) the split is uneven: the embedding counts ``embedding_cost``
   on the first stage and the final norm, head and loss ``head_cost`` on the last (a layer's worth
   each by default), and the split with the smallest most expensive stage is taken (every stage
   keeps at least one block).
2. :func:`stage_indices`: the stages one pipeline rank holds. One per rank (``gpipe``, ``1f1b``);
   round-robin for ``interleaved_1f1b`` (rank r holds r, r + pp, ...); a "V" for the zero-bubble
   schedules ``zbv`` and ``dualpipev`` (rank r holds r and ``2*pp - 1 - r``, so the first and the
   last stage sit on rank 0).
3. The checks a run needs before it builds any group: :func:`check_schedule` (a known name that
   this torch offers, with the number of virtual stages it runs), :func:`check_microbatches` (as
   many as the schedule needs), :func:`check_batch_split` (the batch divides into them). Each
   raises ``ValueError`` naming the value and the fix.

``parallel/pipeline_schedule.py`` turns a checked name into torch's schedule;
``parallel/pipeline_stage.py`` cuts a transformer into stage modules.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "check_batch_split",
    "check_microbatches",
    "check_schedule",
    "split_layers",
    "stage_indices",
]

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule name: torch's class, how stages sit on ranks, and its virtual-stage rule.

    ``virtual_stages`` is the one count the schedule runs (``None``: any count from 2 up).
    ``microbatches_per_stage``: the schedule needs at least one micro-batch per stage of the
    pipeline (``pp * v``); ``rounds``: the count must be a multiple of ``max(1, n // pp)``.
    """

    torch_class: str
    placement: Placement
    virtual_stages: int | None
    microbatches_per_stage: bool = False
    rounds: bool = False


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "single", 1),
    "1f1b": ScheduleSpec("Schedule1F1B", "single", 1, microbatches_per_stage=True),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", None, rounds=True),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, microbatches_per_stage=True),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", 2, microbatches_per_stage=True),
}
_PIPELINING = "torch.distributed.pipelining"


def _check_int(owner: str, name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive int; {fix}.")
    return value


# ---- 1. layers per stage ------------------------------------------------------------------------


def split_layers(
    num_layers: int,
    pp: int,
    virtual_stages: int = 1,
    weights: Sequence[float] | None = None,
    *,
    embedding_cost: float = 1.0,
    head_cost: float = 1.0,
) -> tuple[range, ...]:
    """The block indices of each of the ``pp * virtual_stages`` stages, stage 0 first.

    ``weights=None``: an even split (``pp * virtual_stages`` must divide ``num_layers``). With
    ``weights`` (``num_layers`` positive costs) the split is uneven: a stage costs the sum of its
    blocks, plus ``embedding_cost`` on the first stage and ``head_cost`` on the last; the split
    whose most expensive stage is cheapest is returned (ties: later stages take the extra block).
    Every stage holds at least one block.
    """
    owner = "split_layers"
    _check_int(owner, "num_layers", num_layers, "pass the model's number of blocks")
    _check_int(owner, "pp", pp, "pass the pipeline-parallel degree")
    _check_int(owner, "virtual_stages", virtual_stages, "pass 1, or 2 and up for interleaved schedules")
    stages = pp * virtual_stages
    if num_layers < stages:
        raise ValueError(
            f"{owner}: num_layers={num_layers} is fewer than the {stages} stages (pp={pp} * virtual_stages="
            f"{virtual_stages}); every stage needs a block, so lower pp or virtual_stages."
        )
    if weights is None:
        if num_layers % stages:
            raise ValueError(
                f"{owner}: num_layers={num_layers} does not split evenly into {stages} stages (pp={pp} * "
                f"virtual_stages={virtual_stages}); choose a stage count dividing {num_layers}, or pass "
                "weights=[1.0] * num_layers for an uneven split."
            )
        per = num_layers // stages
        return tuple(range(s * per, (s + 1) * per) for s in range(stages))
    costs = _check_costs(owner, weights, num_layers, embedding_cost, head_cost)
    return _balanced_split(costs, stages, embedding_cost, head_cost)


def _check_costs(owner: str, weights: Sequence[float], num_layers: int, *extra: float) -> list[float]:
    costs = list(weights)
    if len(costs) != num_layers:
        raise ValueError(
            f"{owner}: weights has {len(costs)} entries for num_layers={num_layers}; pass one cost per block."
        )
    for value in (*costs, *extra):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}: cost {value!r} must be a finite number >= 0; pass e.g. 1.0 per block.")
    return [float(c) for c in costs]


def _balanced_split(costs: list[float], stages: int, first_extra: float, last_extra: float) -> tuple[range, ...]:
    """Contiguous split of ``costs`` into ``stages`` non-empty ranges minimising the largest stage cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, lo: int, hi: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: the smallest largest-stage cost of stages s.. over blocks i..n-1; cut[s][i] its first cut
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[n] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = 0.0
    for s in range(stages - 1, -1, -1):
        for i in range(s, n - (stages - 1 - s)):
            for j in range(i + 1, n - (stages - 1 - s) + 1):  # stage s takes blocks i..j-1
                value = max(cost(s, i, j), best[s + 1][j])
                if value < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = value, j
    out, start = [], 0
    for s in range(stages):
        out.append(range(start, cut[s][start]))
        start = cut[s][start]
    return tuple(out)


# ---- 2. stages per rank -------------------------------------------------------------------------


def stage_indices(pp_rank: int, pp: int, schedule: str, virtual_stages: int = 1) -> tuple[int, ...]:
    """The stage indices pipeline rank ``pp_rank`` holds under ``schedule``, in increasing order."""
    spec = _spec(schedule)
    _check_int("stage_indices", "pp", pp, "pass the pipeline-parallel degree")
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"stage_indices: pp_rank={pp_rank!r} must be an int in [0, {pp}); pass this rank's pp coordinate.")
    _check_virtual_stages(schedule, spec, virtual_stages)
    if spec.placement == "v":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(virtual_stages))


# ---- 3. checks before any process group -----------------------------------------------------------


def _spec(schedule: str) -> ScheduleSpec:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule={schedule!r} is unknown; choose one of {sorted(SCHEDULES)}.")
    return SCHEDULES[schedule]


def _check_virtual_stages(schedule: str, spec: ScheduleSpec, virtual_stages: int) -> None:
    _check_int("pipeline", "virtual_stages", virtual_stages, "pass 1, or 2 for interleaved and zero-bubble schedules")
    if spec.virtual_stages is None and virtual_stages < 2:
        raise ValueError(
            f"pipeline: schedule={schedule!r} interleaves stages but virtual_stages={virtual_stages}; "
            "set virtual_stages=2 or more, or use schedule='1f1b'."
        )
    if spec.virtual_stages is not None and virtual_stages != spec.virtual_stages:
        raise ValueError(
            f"pipeline: schedule={schedule!r} runs {spec.virtual_stages} stage(s) per rank but "
            f"virtual_stages={virtual_stages}; set virtual_stages={spec.virtual_stages}."
        )


def check_schedule(schedule: str, virtual_stages: int = 1) -> None:
    """``schedule`` is a known name, this torch has its class, and it runs ``virtual_stages`` per rank."""
    spec = _spec(schedule)
    try:
        module = importlib.import_module(_PIPELINING)
    except ImportError:
        module = None
    if module is None or not hasattr(module, spec.torch_class):
        import torch

        have = sorted(name for name, s in SCHEDULES.items() if module is not None and hasattr(module, s.torch_class))
        raise ValueError(
            f"pipeline: schedule={schedule!r} needs {_PIPELINING}.{spec.torch_class}, which torch "
            f"{torch.__version__} lacks; choose one of {have} or upgrade torch."
        )
    _check_virtual_stages(schedule, spec, virtual_stages)


def check_microbatches(schedule: str, n_microbatches: int, pp: int, virtual_stages: int = 1) -> None:
    """Enough micro-batches for ``schedule`` on ``pp`` ranks with ``virtual_stages`` stages each."""
    spec = _spec(schedule)
    _check_int("pipeline", "n_microbatches", n_microbatches, f"pass at least {pp} (one per pipeline rank)")
    _check_int("pipeline", "pp", pp, "pass the pipeline-parallel degree")
    stages = pp * virtual_stages
    if spec.microbatches_per_stage and n_microbatches < stages:
        raise ValueError(
            f"pipeline: n_microbatches={n_microbatches} is fewer than the {stages} stages schedule={schedule!r} "
            f"runs (pp={pp} * virtual_stages={virtual_stages}); use n_microbatches >= {stages}."
        )
    rounds = max(1, n_microbatches // pp)
    if spec.rounds and n_microbatches % rounds:
        raise ValueError(
            f"pipeline: n_microbatches={n_microbatches} is not a multiple of its {rounds} rounds of pp={pp} "
            f"(schedule={schedule!r}); use a multiple of pp, e.g. n_microbatches={rounds * pp}."
        )


def check_batch_split(batch_size: int, n_microbatches: int) -> int:
    """The micro-batch size: ``batch_size / n_microbatches``, which must be a whole number."""
    _check_int("pipeline", "n_microbatches", n_microbatches, "pass the number of micro-batches per step")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"pipeline: batch_size={batch_size!r} must be a positive int; pass the rows of one step.")
    if batch_size % n_microbatches:
        raise ValueError(
            f"pipeline: batch_size={batch_size} does not divide into n_microbatches={n_microbatches}; "
            f"use a batch size that is a multiple of {n_microbatches}, or a divisor of {batch_size} micro-batches."
        )
    return batch_size // n_microbatches
