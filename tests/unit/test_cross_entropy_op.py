"""Token cross-entropy on CPU: the torch path and its shape errors (the kernel: tests/gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.ops.cross_entropy import token_cross_entropy
from lightning_moe.parallel.vocab import lm_cross_entropy


def test_cpu_path_is_fp32_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, 17, dtype=torch.bfloat16)
    labels = torch.randint(0, 17, (9,))
    labels[2] = -100
    want = F.cross_entropy(logits.float(), labels, reduction="none")
    assert torch.equal(token_cross_entropy(logits, labels), want)


def test_lm_cross_entropy_on_cpu_is_unchanged() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    assert torch.equal(lm_cross_entropy(nn.Identity(), logits, labels), F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="expected logits"):
        token_cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
