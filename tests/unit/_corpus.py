"""Small text corpora of the data tests: random documents from a 16-word vocabulary, written as JSON lines.

``random_docs(n, seed, lo, hi)`` gives ``n`` documents of ``lo`` to ``hi - 1`` words, the same for
the same arguments; ``write_jsonl(path, values, field)`` writes one ``{field: value}`` object per
line (``ids=True`` adds an ``"id"`` key with the line's index, a field the readers skip).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["WORDS", "random_docs", "write_jsonl"]

WORDS = "the quick brown fox jumps over the lazy dog and each token goes to a few experts".split()


def random_docs(n: int, seed: int = 0, lo: int = 1, hi: int = 12) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def write_jsonl(path: Path, values: list[Any], field: str = "text", ids: bool = False) -> Path:
    rows = ({field: v, "id": i} if ids else {field: v} for i, v in enumerate(values))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
