"""Swapped HF models under context parallel and sequence parallel equal one process (gloo, fp32).

Trainer level (``worker_hf_context_fit.py``): a tiny HF Qwen3-MoE (a dense first layer, an MoE
layer with the switch aux loss) trained 3 SGD steps by ``FoldedMoEStrategy`` with FSDP2 — W=4
CP2 × TP2 with sequence parallel and EP2; W=2 CP2; W=2 TP2 with sequence parallel; CP on packed
rows (documents crossing the load-balanced chunk boundaries, positions restarting per document) —
against the same model, batches and steps in one process: the loss of every step, every full
gradient of the first step and every final parameter, ``rtol=1e-5`` (``atol`` 1e-5 of the tensor's
largest value).

Model level (``worker_hf_context.py``, W=2, FSDP off): every HF family the TP plans cut, at TP2
with sequence parallel and at CP2 (plain and packed rows): logits and every gradient. The refused
ones are in ``tests/unit/test_bad_input.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import run_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

W2 = ["cp=2", "tp=2,sp=1", "cp=2,docs=1"]
W4 = ["cp=2,tp=2,sp=1,ep=2", "cp=2,tp=2,sp=1,ep=2,docs=1"]
SP_FAMILIES = (
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe_qk_norm", "dots1", "ernie4_5_moe", "granitemoe",
    "hunyuan_v1_moe", "llama4", "gpt_oss", "qwen3_next_full_attention", "qwen3_5_moe_full_attention",
    "minimax_full_attention",
)  # fmt: skip
CP_FAMILIES = (
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe_qk_norm", "dots1", "ernie4_5_moe", "granitemoe",
    "hunyuan_v1_moe", "deepseek_v2", "deepseek_v3", "qwen3_next_full_attention", "qwen3_5_moe_full_attention",
    "minimax_full_attention",
)  # fmt: skip
CASES = [f"sp:{f}" for f in SP_FAMILIES] + [f"{mode}:{f}" for f in CP_FAMILIES for mode in ("cp", "cpdoc")]


@pytest.fixture(scope="module")
def fit_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_context")
    run_torchrun("worker_hf_context_fit.py", 2, [str(out), *W2], timeout=400)
    run_torchrun("worker_hf_context_fit.py", 4, [str(out), *W4], timeout=500)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = 1e-5 * float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("spec", W4 + W2)
def test_hf_qwen3_moe_fit_under_context_and_sequence_parallel_equals_one_process(fit_results: Path, spec: str) -> None:
    from worker_hf_context_fit import parse, reference

    got = torch.load(fit_results / f"{spec}.pt")
    want = reference(parse(spec)[1])
    _close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), f"{spec} losses")
    for kind in ("grads", "state"):
        assert set(got[kind]) == set(want[kind]), (spec, kind, set(got[kind]) ^ set(want[kind]))
        for name, value in want[kind].items():
            _close(got[kind][name], value, f"{spec} {kind} {name}")


@pytest.fixture(scope="module")
def family_output() -> str:
    return run_torchrun("worker_hf_context.py", 2, CASES, timeout=500)


@pytest.mark.parametrize("case", CASES)
def test_hf_family_under_sequence_or_context_parallel_equals_one_process(family_output: str, case: str) -> None:
    assert f"OK {case} " in family_output, family_output[-4000:]
