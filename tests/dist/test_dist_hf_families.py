"""Each swapped HF family takes one folded_moe EP2 step equal to one HF step in one process.

One 2-rank torchrun job (``worker_hf_families.py``) runs every family in turn; each test reads
its family's line. The tiny fp32 configs are those of ``tests/unit/test_hf_families.py``.
"""

from __future__ import annotations

import pytest
from _harness import launch_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

FAMILIES = (
    "glm4_moe", "olmoe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "granitemoe", "deepseek_v2",
    "deepseek_v2_grouped", "deepseek_v2_grouped_k4", "dots1_top2_groups", "qwen3_next", "qwen3_5_moe", "minimax",
    "llama4", "llama4_top2", "gpt_oss", "gpt_oss_top3",
)  # fmt: skip


@pytest.fixture(scope="module")
def job_output() -> str:
    job = launch_torchrun("worker_hf_families.py", 2, list(FAMILIES), timeout=400)
    assert job.returncode == 0, job.failure()
    return job.output


@pytest.mark.parametrize("family", FAMILIES)
def test_one_ep2_step_equals_one_process(job_output: str, family: str) -> None:
    assert f"FAMILY OK {family} " in job_output, job_output[-4000:]
