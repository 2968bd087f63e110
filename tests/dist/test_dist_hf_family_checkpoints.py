"""HF checkpoints of families with distinct layouts load sharded on 2 folded_moe ranks and export back.

Each checkpoint is written by transformers' ``save_pretrained`` (safetensors, 20 KB shards) from a
tiny random fp32 model (``tests/unit/test_hf_family_checkpoints.py``'s ``build``): Mixtral
(``block_sparse_moe.experts.{i}.w1``), Llama 4 (fused ``[E, H, 2F]`` experts), DeepSeek-V2 (shared
experts, MLA attention), Qwen3-Next (sigmoid-gated shared expert, linear-attention layers), Granite
(fused ``input_linear``, ``router.layer``), ERNIE-4.5 (``moe_statics`` bias ``[1, E]``), gpt-oss
(interleaved gate/up, expert and router biases). At EP2 (and gpt-oss,
DeepSeek-V2, Llama 4 at TP2, their attention cut by its TP plan) the sharded model gives the
one-process HF logits, and its streaming export is the input checkpoint bit for bit
(``worker_hf_family_checkpoints.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _harness import launch_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

ENTRIES = ("mixtral:ep=2", "llama4:ep=2", "llama4:tp=2", "deepseek_v2:ep=2", "deepseek_v2:tp=2", "qwen3_next:ep=2",
           "granitemoe:ep=2", "ernie4_5_moe:ep=2", "gpt_oss:ep=2", "gpt_oss:tp=2")  # fmt: skip


@pytest.fixture(scope="module")
def job_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    from test_hf_family_checkpoints import build

    root = tmp_path_factory.mktemp("hf_family_checkpoints")
    for name in sorted({e.split(":")[0] for e in ENTRIES}):
        build(name).save_pretrained(str(root / name), max_shard_size="20KB")
    job = launch_torchrun("worker_hf_family_checkpoints.py", 2, [str(root), *ENTRIES], timeout=500)
    assert job.returncode == 0, job.failure()
    return job.output


@pytest.mark.parametrize("entry", ENTRIES)
def test_sharded_load_equals_hf_and_exports_bitwise(job_output: str, entry: str) -> None:
    assert f"CKPT OK {entry} " in job_output, job_output[-4000:]
