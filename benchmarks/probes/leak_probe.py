"""Who keeps the optimizer of a finished MoELanguageModel fit alive (e2e contender, one layer)."""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
import e2e  # noqa: E402


def describe(r: object) -> str:
    if isinstance(r, dict):
        owners = [type(o).__name__ for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
        return f"dict(owner={owners[:2]}, keys={list(r)[:6]})"
    if isinstance(r, types.FunctionType):
        return f"function {r.__qualname__} ({r.__code__.co_filename.split('/')[-1]}:{r.__code__.co_firstlineno})"
    if isinstance(r, types.CellType):
        return "cell"
    if isinstance(r, tuple | list):
        return f"{type(r).__name__}(len={len(r)})"
    return type(r).__name__


shape = e2e.Shape(layers=1, steps=2, warmup=1) if torch.cuda.is_available() else e2e.QUICK
e2e.run_one("lightning_moe", shape, "cuda" if torch.cuda.is_available() else "cpu", "folded_moe")
gc.collect()
opts = [o for o in e2e.live_optimizers() if type(o).__name__ == "AdamW"]  # the optimizer, not its Lightning wrapper
print("live AdamW:", len(opts), flush=True)
if opts:
    frontier, seen = [(opts[0], "AdamW")], {id(opts[0])}
    for depth in range(7):
        nxt = []
        for obj, _ in frontier:
            for r in gc.get_referrers(obj):
                if id(r) in seen or isinstance(r, types.FrameType) or r is frontier or r is nxt:
                    continue
                seen.add(id(r))
                d = describe(r)
                print("  " * depth + "<- " + d[:220], flush=True)
                nxt.append((r, d))
        frontier = nxt[:10]
