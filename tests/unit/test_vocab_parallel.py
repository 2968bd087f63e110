"""Vocab-parallel cross-entropy (``parallel/vocab.py``) against ``F.cross_entropy``.

TP 2 and 4 run as threads of this process, each rank with its own gloo group over one in-memory
store (no process start-up). Losses and logit gradients equal the full-vocabulary ones (fp32,
rel 1e-6) with ignored labels, labels that all fall in one rank's slice, only ignored labels and
an empty batch. The embedding and the whole model under TP are checked in
``tests/dist/test_dist_sequence_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _threaded_groups import run_ranks
from lightning_moe.parallel.vocab import (
    lm_cross_entropy,
    mark_vocab_parallel_head,
    vocab_parallel_cross_entropy,
)

V, H = 24, 6
RTOL = 1e-6


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shapes {tuple(got.shape)} vs {tuple(want.shape)}")
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)) if want.numel() else 0.0
    if err > RTOL:
        raise AssertionError(f"{name}: max rel error {err:.2e} > {RTOL}")


def _labels(g: torch.Generator, T: int, vocab_start: int | None = None, v: int = 0) -> torch.Tensor:
    labels = torch.randint(0, V, (T,), generator=g)
    if vocab_start is not None:  # every label inside one rank's slice
        labels = torch.randint(vocab_start, vocab_start + v, (T,), generator=g)
    if T > 3:
        labels[1] = -100
        labels[3] = -100
    return labels


def _check_cross_entropy(group: Any, tp: int, tp_rank: int, seed: int) -> None:
    v = V // tp
    start = tp_rank * v
    for case, T in (("mixed", 10), ("one slice", 7), ("all ignored", 4), ("empty", 0)):
        g = torch.Generator().manual_seed(seed + T)
        logits_TV = torch.randn(T, V, generator=g) * 3
        labels_T = _labels(g, T, vocab_start=v if case == "one slice" else None, v=v)
        if case == "all ignored":
            labels_T[:] = -100
        grad_T = torch.randn(T, generator=g)
        full = logits_TV.clone().requires_grad_(True)
        want = F.cross_entropy(full, labels_T, reduction="none", ignore_index=-100)
        (want * grad_T).sum().backward()
        local = logits_TV[:, start : start + v].clone().requires_grad_(True)
        got = vocab_parallel_cross_entropy(local, labels_T, group, start)
        (got * grad_T).sum().backward()
        _close(f"tp={tp} {case}: loss", got.detach(), want.detach())
        _close(f"tp={tp} {case}: grad", local.grad, full.grad[:, start : start + v])
        if T and case != "all ignored":  # lm_cross_entropy picks the parallel loss for a marked head
            head = nn.Linear(H, v, bias=False)
            mark_vocab_parallel_head(head, group, start)
            model = nn.Sequential(head)
            mean = lm_cross_entropy(model, logits_TV[:, start : start + v].view(1, T, v), labels_T.view(1, T))
            _close(f"tp={tp} {case}: lm_cross_entropy", mean, F.cross_entropy(logits_TV, labels_T))


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy_and_its_gradient(tp: int) -> None:
    run_ranks(tp, lambda group, rank: _check_cross_entropy(group, tp, rank, seed=10 * tp))


def test_lm_cross_entropy_without_a_vocab_parallel_head_is_plain_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g)
    labels = torch.randint(0, V, (2, 5), generator=g)
    labels[0, 0] = -100
    got = lm_cross_entropy(nn.Linear(H, V), logits, labels)
    torch.testing.assert_close(got, F.cross_entropy(logits.flatten(0, 1), labels.flatten()), rtol=0, atol=0)


def test_vocab_parallel_cross_entropy_refuses_unflattened_or_float_labels() -> None:
    group: Any = None  # the checks come before any collective
    with pytest.raises(ValueError, match="flatten"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), group, 0)
    with pytest.raises(TypeError, match="integer token ids"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2), group, 0)
