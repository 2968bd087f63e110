"""Pipeline parallel on gloo ranks equals one process: loss, every gradient, the routers' aux losses.

``worker_pipeline.py`` runs one step of a tiny MoETransformer (fp32, switch load balancing and
z-loss) at ``FoldedLayout(W, pp=2)``: W=2 with ``gpipe`` and ``1f1b`` over 4 micro-batches; W=4
(two pipelines side by side, gradients averaged over dp) with ``interleaved_1f1b`` (2 virtual
stages per rank) and the zero-bubble ``zbv`` and ``dualpipev`` (a "V" of 2 stages per rank).
Every rank's gradients and the mean loss must equal the one-process run over the same
micro-batches to rtol 1e-5, router weights included. One torchrun job per world size.
"""

from __future__ import annotations

import pytest

from _harness import Launch, launch_torchrun

pytestmark = pytest.mark.dist

PARTS = {
    2: ["gpipe:v=1:n=4", "1f1b:v=1:n=4"],
    4: ["interleaved_1f1b:v=2:n=4", "zbv:v=2:n=4", "dualpipev:v=2:n=4"],
}
_CASES = [(world, part) for world, parts in PARTS.items() for part in parts]


@pytest.fixture(scope="module")
def jobs() -> dict[int, Launch]:
    return {}


def _job(jobs: dict[int, Launch], world: int) -> Launch:
    if world not in jobs:
        jobs[world] = launch_torchrun("worker_pipeline.py", world, PARTS[world], timeout=240)
    return jobs[world]


@pytest.mark.parametrize(("world", "part"), _CASES, ids=[f"W{w}-{p}" for w, p in _CASES])
def test_pipeline_step_equals_one_process(jobs: dict[int, Launch], world: int, part: str) -> None:
    job = _job(jobs, world)
    if f"PART OK {part} " not in job.output:
        pytest.fail(f"worker_pipeline part {part!r} did not finish:\n{job.failure() or job.output[-6000:]}", pytrace=False)
