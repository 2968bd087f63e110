"""The train and validation rows of ``TextDataModule(cache_dir=...)``: token shards plus a stored row layout.

:func:`sharded_splits` makes sure the shard sets exist (``shard_cache.py``: built once, reused while
source and tokenizer match), then the row layout for this ``seq_len``/``packing``/split
(``row_layout.py``: ``<cache_dir>/rows-<hash>``, named after the shard sets' headers and every
argument that moves a row, built once per combination), and returns the two
:class:`~lightning_moe.data.shard_rows.ShardRowsDataset` s with the layout's per-split summary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from lightning_moe.data.row_layout import LAYOUT_NAME, SEGMENT_FIELDS, LayoutSpec, build_row_layout, layout_files
from lightning_moe.data.shard_cache import ShardSource, ensure_token_shards
from lightning_moe.data.shard_reader import TokenShards
from lightning_moe.data.shard_rows import ShardRowsDataset

__all__ = ["ShardedSplits", "sharded_splits"]

SPLITS = ("train", "validation")


class ShardedSplits(NamedTuple):
    """Both splits' datasets, the layout summary (per split: rows, documents, long, first_long) and
    the source each split's document numbers refer to."""

    train: ShardRowsDataset
    validation: ShardRowsDataset
    summary: dict[str, dict[str, Any]]
    sources: dict[str, ShardSource]


def _complete_layout(folder: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((folder / LAYOUT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for split in SPLITS:
        if split not in summary:
            return None
        rows, segments = layout_files(folder, split)
        sizes = {rows: (summary[split]["rows"] + 1) * 8, segments: summary[split]["segments"] * SEGMENT_FIELDS * 8}
        if any(not p.is_file() or p.stat().st_size != size for p, size in sizes.items()):
            return None
    return summary


def sharded_splits(cache_dir: str | Path, train: ShardSource, validation: ShardSource | None, tokenizer: Any,
                   tokenizer_dir: str | Path, spec: LayoutSpec, held_out: tuple[int, float], eos_id: int,
                   owner: str = "TextDataModule") -> ShardedSplits:  # fmt: skip
    """Shards, layout and datasets (module doc). ``validation=None`` holds out documents of ``train``
    by ``held_out=(seed, val_fraction)``; else ``held_out`` is unused."""
    sources = {"train": train, "validation": validation if validation is not None else train}
    shards = {name: TokenShards(ensure_token_shards(cache_dir, src, tokenizer, tokenizer_dir, owner))
              for name, src in sources.items()}  # fmt: skip
    if validation is None:
        del shards["validation"]
    made_from = {name: {k: s.header[k] for k in ("source", "tokenizer", "documents", "tokens")}
                 for name, s in shards.items()}  # fmt: skip
    identity = {"spec": asdict(spec), "held_out": list(held_out) if validation is None else None, "shards": made_from}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / f"rows-{digest}"
    summary = _complete_layout(folder)
    if summary is None:
        summary = build_row_layout(folder, spec, shards, held_out if validation is None else None)
    by_split = {name: shards["train" if validation is None else name] for name in SPLITS}
    datasets = [ShardRowsDataset(by_split[name], folder, name, summary[name]["rows"], spec.seq_len, eos_id,
                                 spec.packing) for name in SPLITS]  # fmt: skip
    return ShardedSplits(datasets[0], datasets[1], summary, sources)
