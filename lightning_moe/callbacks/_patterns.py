"""Shared by CPUOffload and CUDAGraphCapture: pick sub-modules by fnmatch patterns on their names."""

from __future__ import annotations

import re
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch.nn as nn

__all__ = ["available_names", "select_modules"]

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def available_names(root: nn.Module, limit: int = 40) -> list[str]:
    """Qualified sub-module names with list indices folded to ``*`` (``layers.*.attn``), deduplicated."""
    folded: list[str] = []
    for name, _ in root.named_modules():
        if not name:
            continue
        short = _INDEX.sub(".*", name)
        if short not in folded:
            folded.append(short)
    return folded[:limit] + ([f"... ({len(folded) - limit} more)"] if len(folded) > limit else [])


def select_modules(owner: str, root: nn.Module, patterns: Sequence[str], arg: str) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the outermost sub-modules whose qualified name matches a pattern.

    Patterns are ``fnmatch`` patterns on ``named_modules()`` names (``*`` also matches dots), so
    ``"*layers.*.ffn"`` selects every block's FFN whether the model sits at the root or under a
    LightningModule attribute. A pattern that matches nothing raises, listing the names there are.
    A module inside an already selected one is dropped (its tensors belong to the outer one).
    """
    if isinstance(patterns, str):
        raise ValueError(f"{owner}: {arg}={patterns!r} must be a list of patterns; write {arg}=[{patterns!r}].")
    named = [(name, module) for name, module in root.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name, _ in named):
            raise ValueError(
                f"{owner}: {arg} pattern {pattern!r} matches no sub-module of {type(root).__name__}; "
                f"available names (indices shown as *): {available_names(root)}. Patterns are fnmatch "
                "patterns on qualified module names, e.g. '*layers.*.ffn'."
            )
    hits = [name for name, _ in named if any(fnmatchcase(name, p) for p in patterns)]
    hit_set = set(hits)
    outermost = {n for n in hits if not any(a in hit_set for a in _ancestors(n))}
    return [(name, module) for name, module in named if name in outermost]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
