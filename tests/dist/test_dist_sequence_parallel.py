"""Sequence parallel and the vocab-parallel head on 4 gloo ranks equal one process.

One torchrun job (``worker_sequence_parallel.py``) runs every layout: ``parallelize_moe_model``
on a FoldedMesh with FSDP2, an MoETransformer (dense block, MoE blocks with a shared expert,
q/k norms, switch aux loss and z-loss) trained 3 SGD steps, fp32, against the same model in one
process trained on every DP shard. Layouts: TP2·SP·DP2 with EP4; TP2·SP with ETP2·EP2 (flex and
per-slot all-to-all; with norms, MoE activations and attention recomputed); the vocab-parallel
head with and without SP; TP2 without SP (the baseline for the routed-row counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _harness import run_torchrun

pytestmark = pytest.mark.dist

WORLD, RTOL = 4, 1e-5
SP_EP4 = "tp=2,ep=4,sp=1"  # first: the saved-activation measurement runs with it
SP_ETP2 = "tp=2,ep=2,etp=2,sp=1"
NO_SP = "tp=2,ep=4"
LAYOUTS = [
    SP_EP4,
    SP_ETP2,
    "tp=2,ep=2,etp=2,sp=1,vp=1,dispatcher=alltoall",
    "tp=2,ep=2,etp=2,sp=1,recompute=1",
    "tp=2,ep=4,sp=1,vp=1",
    "tp=2,ep=4,vp=1",
    NO_SP,
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sequence_parallel")
    run_torchrun("worker_sequence_parallel.py", WORLD, [str(out), *LAYOUTS, "vocab"], timeout=570)
    return out


def _load(out: Path, spec: str) -> dict:
    return torch.load(out / f"{spec}.pt")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = RTOL * float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def test_vocab_parallel_embedding_and_cross_entropy_match_plain_pytorch_at_tp2_and_tp4(results: Path) -> None:
    errors = torch.load(results / "vocab.pt")["errors"]
    assert len(errors) == WORLD and all(len(e) == 16 for e in errors)
    for rank, per_rank in enumerate(errors):
        bad = {name: err for name, err in per_rank.items() if not err <= 1e-6}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("spec", LAYOUTS)
def test_layout_matches_one_process(results: Path, spec: str) -> None:
    """Every rank's loss per step, the gradients after the first backward (and their global
    norm) and the parameters after 3 SGD steps equal the one-process run (rtol 1e-5)."""
    r = _load(results, spec)
    for rank, (got, want) in enumerate(zip(r["losses"], r["ref_losses"])):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=RTOL,
                                   msg=lambda m: f"{spec} rank {rank} losses: {m}")  # fmt: skip
    for key in ("grads", "state"):
        got, want = r[key], r[f"ref_{key}"]
        assert set(got) == set(want), f"{spec} {key}: {sorted(set(got) ^ set(want))}"
        for name in want:
            _close(got[name], want[name], f"{spec} {key} {name}")
    for rank, (norm, ref_norm) in enumerate(r["grad_norms"]):  # the norm clipping reads
        assert abs(norm - ref_norm) <= RTOL * ref_norm, f"{spec} rank {rank}: grad norm {norm} vs {ref_norm}"


def test_sequence_parallel_routes_each_token_once(results: Path) -> None:
    """With SP every rank's MoE layers get its S/tp positions, the slots dispatched over a TP
    group are its tokens times top_k, and the rows the experts process over the world are all
    tokens times top_k (times etp: each ETP rank computes its F slice of every row of its ETP
    group). Without SP each TP rank routes the whole sequence: tp times the rows."""
    sp, etp2, base = _load(results, SP_EP4), _load(results, SP_ETP2), _load(results, NO_SP)
    k, T = sp["top_k"], sp["tokens_per_rank"] * 2  # T: tokens of one TP group (B*S)
    assert sp["tokens_per_rank"] == T // 2 and base["tokens_per_rank"] == T
    layers = len(sp["moe_tokens"][0])
    assert layers == 2
    for r in (sp, etp2):
        for group in r["tp_groups"]:
            for layer in range(layers):
                assert sum(r["moe_tokens"][rank][layer] * k for rank in group) == T * k
        for layer in range(layers):
            rows = sum(per_rank[layer] for per_rank in r["expert_rows"])
            assert rows == r["etp"] * WORLD * (T // 2) * k, (r["etp"], rows)
    for layer in range(layers):
        assert sum(per_rank[layer] for per_rank in base["expert_rows"]) == 2 * WORLD * (T // 2) * k


def test_sequence_parallel_halves_saved_norm_activations_at_tp2(results: Path) -> None:
    """Bytes autograd saves inside the residual norms, per rank, TP2 with SP over one process."""
    saved = _load(results, SP_EP4)["saved"]
    ratio = saved["parallel"]["norms"] / saved["tp1"]["norms"]
    assert ratio <= 0.55, saved
    assert saved["parallel"]["block"] / saved["tp1"]["block"] <= 0.6, saved
