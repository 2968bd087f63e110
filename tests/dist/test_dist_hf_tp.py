"""Each swapped HF family at TP2, cut by its own projection names (``parallel/tp_plans.py``), gives
the one-process logits and gradients (fp32, 1e-5).

One 2-rank torchrun job (``worker_hf_tp.py``) runs every family in turn; each test reads its
family's line. Covered: DeepSeek-V2/V3 MLA (with and without ``q_lora_rank``; the shared rotary key
columns), Qwen3-Next's and Qwen3.5's gated query (full-attention layers only, as for MiniMax: their
linear-attention layers are refused), OLMoE's full-width q/k norms, HunYuan's per-head norms on
``[B, heads, S, D]``, Llama 4 (MoE and dense ``feed_forward``), Mixtral, Qwen2-MoE (q/k/v biases),
Qwen3-MoE, GLM-4-MoE with q/k norms, ERNIE-4.5, Granite, dots1, gpt-oss (per-head attention sinks
cut with the heads).
"""

from __future__ import annotations

import pytest
from _harness import launch_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

FAMILIES = (
    "deepseek_v2", "deepseek_v2_no_q_lora", "deepseek_v3", "qwen3_next_full_attention", "olmoe", "hunyuan_v1_moe",
    "llama4", "llama4_dense_mlp", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe_qk_norm", "ernie4_5_moe",
    "granitemoe", "dots1", "gpt_oss", "qwen3_5_moe_full_attention", "minimax_full_attention",
)  # fmt: skip


@pytest.fixture(scope="module")
def job_output() -> str:
    job = launch_torchrun("worker_hf_tp.py", 2, list(FAMILIES), timeout=500)
    assert job.returncode == 0, job.failure()
    return job.output


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_one_process(job_output: str, family: str) -> None:
    assert f"TP OK {family} " in job_output, job_output[-4000:]
