"""One torchrun job per world size for the whole dist test run.

Starting W processes that import torch and Lightning takes longer on 2 cores than most of the
checks they run, so tests do not launch their own jobs. A test names the parts it needs with a
marker (``@pytest.mark.suite4("fit:ep=4")``) and takes the session-scoped fixture of that world size
(``suite2``, ``suite4``, ``suite8``). The fixture collects the parts of every *selected* test, runs them in
one ``worker_suite.py`` job (with a timeout, so a hang fails) and hands each test its result:
``suite.check(part)`` fails that test, with the job's output, if its part did not finish.

Selecting one test (``pytest tests/dist/test_dist_fit.py -k ep=2``) runs only its parts.
"""

from __future__ import annotations

import pytest

from _harness import SELECTED_TESTS, Suite, launch_torchrun, selected_tests

# parts run cheapest and most basic first: a dispatcher bug shows before the Trainer tests
_KIND_ORDER = ("dispatch", "fit", "fabric", "ckpt", "echo", "replay", "resume")
_BASE_TIMEOUT_S, _PART_TIMEOUT_S, _MAX_TIMEOUT_S = 120.0, 60.0, 570.0  # below pytest-timeout's 600 s


def pytest_configure(config: pytest.Config) -> None:
    for world in (2, 4, 8):
        config.addinivalue_line(
            "markers", f"suite{world}(*parts): worker_suite.py parts this test needs on {world} gloo ranks"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the list of collected tests: ``-k``, ``-m`` and ``--deselect`` remove tests from this
    same list in place, so after collection it holds exactly the tests that run."""
    config.stash[SELECTED_TESTS] = items


def _run_suite(request: pytest.FixtureRequest, factory: pytest.TempPathFactory, world: int) -> Suite:
    marker = f"suite{world}"
    parts: list[str] = []
    for item in selected_tests(request.config):
        for mark in item.iter_markers(marker):
            parts += [p for p in mark.args if p not in parts]
    parts.sort(key=lambda p: _KIND_ORDER.index(p.split(":")[0]) if p.split(":")[0] in _KIND_ORDER else 99)
    out = factory.mktemp(marker)
    timeout = min(_BASE_TIMEOUT_S + _PART_TIMEOUT_S * len(parts), _MAX_TIMEOUT_S)
    job = launch_torchrun("worker_suite.py", world, [str(out), *parts], timeout=timeout)
    (out / "job.log").write_text(job.output)  # every part's "PART OK <part> <seconds>s" line is in here
    return Suite(out, job)


@pytest.fixture(scope="session")
def suite2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    return _run_suite(request, tmp_path_factory, 2)


@pytest.fixture(scope="session")
def suite4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    return _run_suite(request, tmp_path_factory, 4)


@pytest.fixture(scope="session")
def suite8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    return _run_suite(request, tmp_path_factory, 8)
