"""Sequence-parallel collectives (``parallel/sequence.py``) and the checks of ``parallelize_moe_model``.

The collectives run on TP 2 and 4 as threads of this process (one gloo group per rank over an
in-memory store): forward equals slicing / concatenating / summing the full tensors, backward is
the adjoint (checked against autograd through the same ops on the full tensors). The checks of
``sequence_parallel`` / ``vocab_parallel`` raise before any collective, so they run on a plain model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _threaded_groups import run_ranks
from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.parallelize import check_model_for_layout
from lightning_moe.parallel.sequence import gather_from_sequence, reduce_scatter_to_sequence, scatter_to_sequence


def _inputs(tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tp)
    B, S, H = 2, 3 * tp, 5
    x_tBSH = torch.randn(tp, B, S, H, generator=g, dtype=torch.float64)  # one [B, S, H] per rank
    c_BSH = torch.randn(B, S, H, generator=g, dtype=torch.float64)  # the upstream gradient's weights
    c_tBSH = torch.randn(tp, B, S, H, generator=g, dtype=torch.float64)
    return x_tBSH, c_BSH, c_tBSH


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_collectives_equal_their_full_tensor_definitions_and_adjoints(tp: int) -> None:
    x_tBSH, c_BSH, c_tBSH = _inputs(tp)
    S = x_tBSH.shape[2]
    s = S // tp

    def body(group: Any, r: int) -> None:
        mine = slice(r * s, (r + 1) * s)
        # scatter: this rank's slice of a tensor all ranks hold; backward all-gathers -> the full gradient
        x = x_tBSH[0].clone().requires_grad_(True)
        out = scatter_to_sequence(x, group)
        torch.testing.assert_close(out, x_tBSH[0][:, mine])
        (out * c_BSH[:, mine]).sum().backward()
        torch.testing.assert_close(x.grad, c_BSH)
        # gather (replicated consumer): the whole sequence; backward keeps this rank's slice
        x = x_tBSH[0][:, mine].clone().requires_grad_(True)
        out = gather_from_sequence(x, group)
        torch.testing.assert_close(out, x_tBSH[0])
        (out * c_BSH).sum().backward()
        torch.testing.assert_close(x.grad, c_BSH[:, mine])
        # gather (tensor-parallel consumer): backward sums every rank's partial gradient of the slice
        x = x_tBSH[0][:, mine].clone().requires_grad_(True)
        (gather_from_sequence(x, group, partial_grad=True) * c_tBSH[r]).sum().backward()
        torch.testing.assert_close(x.grad, c_tBSH.sum(0)[:, mine])
        # reduce-scatter: the sum over ranks, this rank's slice; backward all-gathers
        x = x_tBSH[r].clone().requires_grad_(True)
        out = reduce_scatter_to_sequence(x, group)
        torch.testing.assert_close(out, x_tBSH.sum(0)[:, mine])
        (out * c_tBSH[r][:, mine]).sum().backward()
        torch.testing.assert_close(x.grad, torch.cat([c_tBSH[q][:, q * s : (q + 1) * s] for q in range(tp)], 1))

    run_ranks(tp, body)


def test_a_sequence_not_divisible_by_tp_is_refused_before_any_collective() -> None:
    def body(group: Any, r: int) -> None:
        with pytest.raises(ValueError, match="sequence length 5 is not divisible by the TP group size 2"):
            scatter_to_sequence(torch.zeros(1, 5, 3), group)
        with pytest.raises(ValueError, match="sequence length 5 is not divisible"):
            reduce_scatter_to_sequence(torch.zeros(1, 5, 3), group)

    run_ranks(2, body)


def _model(vocab: int = 64, tie: bool = False, aux_loss: str = "switch") -> MoETransformer:
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, aux_loss=aux_loss)  # type: ignore[arg-type]
    cfg = TransformerConfig(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, moe=moe, tie_embeddings=tie)
    return MoETransformer(cfg)


def test_sequence_and_vocab_parallel_checks() -> None:
    tp2 = FoldedLayout(4, tp=2, ep=2)
    check_model_for_layout(_model(), tp2, sequence_parallel=True, vocab_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tp > 1"):
        check_model_for_layout(_model(), FoldedLayout(2, ep=2), sequence_parallel=True)
    with pytest.raises(ValueError, match="vocab_parallel=True needs tp > 1"):
        check_model_for_layout(_model(), FoldedLayout(2, ep=2), vocab_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel=1 must be a bool"):
        check_model_for_layout(_model(), tp2, sequence_parallel=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tied embeddings"):
        check_model_for_layout(_model(tie=True), tp2, vocab_parallel=True)
    check_model_for_layout(_model(tie=True), tp2, sequence_parallel=True)  # tied is fine without vocab_parallel
    with pytest.raises(ValueError, match="vocab_size=66 divisible by tp=4; pad the vocabulary to 68"):
        check_model_for_layout(_model(vocab=66), FoldedLayout(4, tp=4, ep=2), vocab_parallel=True)
    for aux in ("seq", "global"):
        with pytest.raises(ValueError, match=f"aux_loss='{aux}'"):
            check_model_for_layout(_model(aux_loss=aux), tp2, sequence_parallel=True)
    with pytest.raises(ValueError, match="MoETransformer-shaped model"):
        check_model_for_layout(torch.nn.Sequential(torch.nn.Linear(4, 4)), tp2, sequence_parallel=True)


def test_etp_groups_outside_a_tp_group_are_accepted_only_with_sequence_parallel() -> None:
    # ep fastest: TP groups [0,1],[2,3] but ETP groups [0,2],[1,3] (ranks holding different tokens without SP)
    layout = FoldedLayout(4, tp=2, ep=2, etp=2, order="ep-tp-cp-dp-pp")
    with pytest.raises(ValueError, match="outside one TP group"):
        check_model_for_layout(_model(), layout)
    check_model_for_layout(_model(), layout, sequence_parallel=True)


def test_sequence_collectives_take_an_empty_batch() -> None:
    def body(group: Any, r: int) -> None:
        x = torch.zeros(0, 4, 3, requires_grad=True)
        y = scatter_to_sequence(x, group)
        z = gather_from_sequence(y, group, partial_grad=True)
        out = reduce_scatter_to_sequence(z, group)
        out.sum().backward()
        assert y.shape == (0, 2, 3) and z.shape == (0, 4, 3) and out.shape == (0, 2, 3)
        assert x.grad is not None and x.grad.shape == (0, 4, 3)

    run_ranks(2, body)
