"""ECHO expert cloning under FoldedMoEStrategy(ep=4) on 4 gloo ranks (the ``echo`` suite part).

The routers are biased so every token takes expert 0 (home: EP rank 0) plus one other, so EP
rank 0 processes ~2.3x the mean load. Checked:

(a) losses and parameters after 5 steps equal the run without ECHO to 1e-5 (fp32);
(b) the monitor's max/mean rows per EP rank drops from >= 2.0 to <= 1.25 once clones exist;
(c) a checkpoint taken with clones active resumes without them, on the plain run's trajectory.
"""

from __future__ import annotations

import pytest
import torch
from _harness import Suite

pytestmark = [pytest.mark.dist, pytest.mark.suite4("echo")]  # the shared 4-rank job (conftest.py)

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def results(suite4: Suite) -> dict:
    suite4.check("echo")
    return torch.load(suite4.out / "echo.pt", weights_only=False)


def test_echo_matches_the_plain_run_in_losses_and_parameters(results: dict) -> None:
    plain, echo = results["plain"], results["echo"]
    for rank, ((plain_losses, _, _), (echo_losses, _, clones)) in enumerate(zip(plain["per_rank"], echo["per_rank"])):
        assert len(echo_losses) == 10 and max(clones) > 0, rank  # 5 steps x 2 micro-batches, clones used
        torch.testing.assert_close(torch.tensor(echo_losses), torch.tensor(plain_losses), **TOL)
    assert set(echo["state"]) == set(plain["state"])
    for name, want in plain["state"].items():
        torch.testing.assert_close(echo["state"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_monitor_reports_flatter_ep_load_with_echo(results: dict) -> None:
    _, plain_load, _ = results["plain"]["per_rank"][0]
    _, echo_load, echo_clones = results["echo"]["per_rank"][0]
    assert min(plain_load) >= 2.0, plain_load
    assert echo_clones[0] == 0 and echo_load[0] >= 2.0, echo_load  # step 0 routes before the first plan
    assert max(echo_load[1:]) <= 1.25, echo_load
    assert all(c > 0 for c in echo_clones[1:]), echo_clones


@pytest.mark.suite4("echo:alltoall_dedup")
def test_echo_over_the_deduplicating_exchange_matches_plain_and_flattens_load(suite4: Suite) -> None:
    """(a) and (b) with dispatcher='alltoall_dedup' (the clones ride the same exchange)."""
    suite4.check("echo:alltoall_dedup")
    results = torch.load(suite4.out / "echo_alltoall_dedup.pt", weights_only=False)
    plain, echo = results["plain"], results["echo"]
    assert echo["dispatchers"] == plain["dispatchers"] == ["FlexDispatcher"]  # the callback unwraps at teardown
    for (plain_losses, plain_load, _), (echo_losses, echo_load, clones) in zip(plain["per_rank"], echo["per_rank"]):
        assert max(clones) > 0
        torch.testing.assert_close(torch.tensor(echo_losses), torch.tensor(plain_losses), **TOL)
        assert min(plain_load) >= 2.0 and max(echo_load[1:]) <= 1.25, (plain_load, echo_load)
    for name, want in plain["state"].items():
        torch.testing.assert_close(echo["state"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpoint_with_active_clones_resumes_without_them(results: dict) -> None:
    plain, resumed = results["plain"], results["resumed"]
    assert resumed["dispatchers"] == ["AllToAllDispatcher"]  # no ECHO wrapper left, none restored
    for (plain_losses, _, _), (resumed_losses, _, clones) in zip(plain["per_rank"], resumed["per_rank"]):
        assert clones == [0, 0]
        torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(plain_losses[6:]), **TOL)
    for name, want in plain["state"].items():
        torch.testing.assert_close(resumed["state"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
