"""``pp_overlap_expert_comm``: one micro-batch's expert all-to-all in flight while another computes.

One torchrun job at W=4 (``worker_pipeline_overlap.py``): PP2 x EP2 (dp 2) with dualpipev over 4
stages of one block (stage 0 dense, stages 1-3 MoE; rank pp 0 holds stages 0 and 3, pp 1 stages 1
and 2), 4 micro-batches, 2 SGD steps, with the overlap off and on, for each all-to-all dispatcher
and for the options the overlap is accepted with: activation recompute of the MoE layer
(``recompute=["moe"]``) and of the whole block (``["block"]``), whose backward runs the layer's
dispatch and combine again, and FP8 (FP8 rows through the dispatch all-to-all, FP8 dense layers).
A second job at W=8 adds ``tp=2`` with sequence parallel and ``etp=2`` (PP2 x TP2 x EP2, dp 2):
the TP and expert-TP all-gathers and reduce-scatters of both sides run between the hand-overs.
From each rank's recorded events (issue and wait of every all-to-all, autograd's saved-tensor
packs and unpacks as compute, the overlapped pairs):

* off: one thread, every all-to-all synchronous and waited for before anything else happens;
* on: the steady state's overlapped actions run their forward on the main thread and their
  backward on a helper thread; whenever the other side still has work, an asynchronous all-to-all
  is in flight while the other side runs (between its issue and its wait there are the other side's
  events), and the other side computes in some of those windows: the backward during a forward's
  all-to-all on every rank, the forward during a backward's all-to-all on the pp rank whose two
  stages are both MoE (not checked under recompute, whose checkpoint keeps the forward's saved
  tensors from the recording hooks);
* under recompute the helper thread issues more all-to-alls than without: the recomputed forward's,
  taking turns like the backward's own;
* the losses and the final parameters are bitwise those of the run without overlap (which the
  dualpipev case of ``test_dist_pipeline_fit.py`` compares with one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from _harness import Launch, launch_torchrun

pytestmark = pytest.mark.dist

DISPATCHERS = ("alltoall_dedup", "alltoall")
# runs without the overlap's mode: <dispatcher>[-<variant>] (worker_pipeline_overlap.VARIANTS)
RECOMPUTE = ("alltoall_dedup-recompute_moe", "alltoall-recompute_block")
RUNS_W4 = (*DISPATCHERS, *RECOMPUTE, "alltoall_dedup-fp8")
RUNS_W8 = ("alltoall_dedup-sp_etp",)
MAIN = "MainThread"


def _launch(factory: pytest.TempPathFactory, world: int, runs: tuple[str, ...]) -> tuple[Path, Launch]:
    out = factory.mktemp(f"pipeline_overlap_w{world}")
    names = [f"{run}-{mode}" for run in runs for mode in ("off", "on")]
    return out, launch_torchrun("worker_pipeline_overlap.py", world, [str(out), *names], timeout=400)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Launch]:
    return _launch(tmp_path_factory, 4, RUNS_W4)


@pytest.fixture(scope="module")
def job8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Launch]:
    return _launch(tmp_path_factory, 8, RUNS_W8)


def _result(request: pytest.FixtureRequest, run: str) -> dict[str, Any]:
    """``run``'s output, from the job of its world size (started by the first test that needs it)."""
    out, launch = request.getfixturevalue("job8" if run.rsplit("-", 1)[0] in RUNS_W8 else "job")
    if f"DONE {run}" not in launch.output:
        pytest.fail(f"worker_pipeline_overlap {run!r} did not finish:\n{launch.failure() or launch.output[-6000:]}")
    return torch.load(out / f"{run}.pt")


@dataclass(frozen=True)
class Window:
    """One asynchronous all-to-all of an overlapped pair, from its issue to its wait."""

    side: str  # "forward" (main thread) or "backward" (the helper thread)
    partner_later: bool  # the other side has events after the issue, in the same pair
    partner_ran: bool  # ... between the issue and the wait
    partner_computed: bool  # ... and computed there


def pair_segments(events: list[tuple[Any, ...]]) -> tuple[list[list[tuple[Any, ...]]], list[tuple[Any, ...]]]:
    """The events of each overlapped pair, and the events outside every pair."""
    segments: list[list[tuple[Any, ...]]] = []
    outside: list[tuple[Any, ...]] = []
    current: list[tuple[Any, ...]] | None = None
    for event in events:
        if event == ("pair", "begin"):
            current = []
        elif event == ("pair", "end"):
            segments.append(current or [])
            current = None
        else:
            (outside if current is None else current).append(event)
    return segments, outside


def windows(segment: list[tuple[Any, ...]]) -> list[Window]:
    """Every asynchronous all-to-all of one pair with what the other side did while it was in flight."""
    found = []
    for i, event in enumerate(segment):
        if event[0] != "issue" or not event[2]:
            continue
        me = event[1]
        j = next(k for k in range(i + 1, len(segment)) if segment[k] == ("wait", me))
        partner = [k for k in range(i + 1, len(segment)) if segment[k][1] != me]
        inside = [k for k in partner if k < j]
        found.append(
            Window(
                side="forward" if me == MAIN else "backward",
                partner_later=bool(partner),
                partner_ran=bool(inside),
                partner_computed=any(segment[k][0] == "compute" for k in inside),
            )
        )
    return found


@pytest.mark.parametrize("run", RUNS_W4 + RUNS_W8)
def test_without_overlap_every_all_to_all_completes_before_anything_else(request: Any, run: str) -> None:
    for rank, result in enumerate(_result(request, f"{run}-off")["ranks"]):
        events = result["events"]
        assert ("pair", "begin") not in events, rank
        assert {e[1] for e in events} == {MAIN}, (rank, {e[1] for e in events})
        issues = [i for i, e in enumerate(events) if e[0] == "issue"]
        assert issues, rank
        for i in issues:
            assert events[i][2] is False and events[i + 1] == ("wait", MAIN), (rank, i, events[i : i + 2])


@pytest.mark.parametrize("run", RUNS_W4 + RUNS_W8)
def test_overlap_keeps_one_all_to_all_in_flight_while_the_other_micro_batch_computes(request: Any, run: str) -> None:
    for rank, result in enumerate(_result(request, f"{run}-on")["ranks"]):
        segments, outside = pair_segments(result["events"])
        assert segments, f"rank {rank}: no overlapped forward+backward action ran"
        assert {e[1] for e in outside} == {MAIN}, rank  # the backward leaves the main thread only in a pair
        found = [w for segment in segments for w in windows(segment)]
        waited_alone = [w for w in found if w.partner_later and not w.partner_ran]
        assert not waited_alone, f"rank {rank}: {len(waited_alone)} all-to-alls waited for before the other side ran"
        assert any(w.side == "forward" and w.partner_computed for w in found), f"rank {rank}: {found}"
        if result["pp"] == 1 and run not in RECOMPUTE:  # stages 1 and 2, both MoE: the turns go both ways
            assert any(w.side == "backward" and w.partner_computed for w in found), f"rank {rank}: {found}"


@pytest.mark.parametrize("run", RECOMPUTE)
def test_recompute_runs_the_forwards_all_to_alls_again_on_the_backward_side(request: Any, run: str) -> None:
    plain = _result(request, f"{run.split('-')[0]}-on")["ranks"]
    for rank, result in enumerate(_result(request, f"{run}-on")["ranks"]):
        counts = [sum(1 for e in r["events"] if e[0] == "issue" and e[1] != MAIN) for r in (plain[rank], result)]
        assert counts[1] > counts[0], f"rank {rank}: the helper thread issued {counts} all-to-alls (plain, recompute)"


@pytest.mark.parametrize("run", RUNS_W4 + RUNS_W8)
def test_overlap_changes_no_number(request: Any, run: str) -> None:
    off, on = _result(request, f"{run}-off"), _result(request, f"{run}-on")
    assert [r["losses"] for r in on["ranks"]] == [r["losses"] for r in off["ranks"]]
    assert off["state"].keys() == on["state"].keys() and off["state"]
    for name, value in off["state"].items():
        assert torch.equal(on["state"][name], value), name
