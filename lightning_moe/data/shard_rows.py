"""Rows read from token shards through a stored row layout: a map-style dataset of constant memory.

Legend: S sequence length (``seq_len``), G segments of one row.

Item ``r`` of :class:`ShardRowsDataset` gathers row ``r``'s segments (``row_layout.py``) from the
shards (``shard_reader.py``) into ``seq_len + 1`` tokens and turns them into the batch keys
the same way the in-memory rows are made, so the two paths give identical items:

* ``packing="pack"``: tokens and document slots go through ``packing.packed_example`` (labels
  -100 across documents and at padding, position and document ids); in SFT a label is kept only
  where the mask of its token is 1 (the EOS after a chat has mask 0).
* ``packing="none"``: one piece of one document, padded with EOS; labels where a next token of
  the piece exists (and, in SFT, is the assistant's).

The layout and shard files are read with positional reads (``shard_reader.ArrayFile``) of the few
bytes a row needs, opened on first use in each process (``DataLoader`` workers too).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_moe.data.packing import IGNORE_INDEX, PAD_SLOT, packed_example
from lightning_moe.data.row_layout import SEGMENT_FIELDS, layout_files
from lightning_moe.data.shard_reader import ArrayFile, TokenShards

__all__ = ["ShardRowsDataset"]


class ShardRowsDataset(Dataset[dict[str, torch.Tensor]]):
    """The rows of split ``split`` of the layout in ``layout_dir`` over ``shards`` (module doc).

    Args:
        shards: the documents the layout's segments point into.
        layout_dir: a folder ``build_row_layout`` wrote.
        split: ``"train"`` or ``"validation"``.
        rows: the split's row count (``layout.json``).
        seq_len: tokens per row.
        eos_id: the EOS after each document and the padding of unpacked rows.
        packing: ``"pack"`` or ``"none"``, as the layout was built.
    """

    def __init__(self, shards: TokenShards, layout_dir: str | Path, split: str, rows: int, seq_len: int, eos_id: int,
                 packing: str) -> None:  # fmt: skip
        self.shards = shards
        rows_path, segments_path = layout_files(Path(layout_dir), split)
        self._first_segment, self._segments = ArrayFile(rows_path, "<i8"), ArrayFile(segments_path, "<i8")
        self.num_rows, self.seq_len, self.eos_id, self.packing = rows, seq_len, eos_id, packing

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"ShardRowsDataset: index {index} out of range for {len(self)} rows")
        index %= len(self)
        first, end = self._first_segment.read(index, 2).tolist()
        flat = self._segments.read(first * SEGMENT_FIELDS, (end - first) * SEGMENT_FIELDS)
        row_segments = flat.reshape(-1, SEGMENT_FIELDS)
        if self.packing == "pack":
            return self._packed(row_segments)
        return self._single(row_segments[0])

    def _packed(self, segments_G5: np.ndarray) -> dict[str, torch.Tensor]:
        row_len = self.seq_len + 1
        tokens = np.zeros(row_len, dtype=np.int64)
        slots = np.full(row_len, PAD_SLOT, dtype=np.int32)
        masks = np.zeros(row_len, dtype=np.int64) if self.shards.has_masks else None
        for offset, doc, first, length, slot in segments_G5.tolist():
            tokens[offset : offset + length] = self.shards.unit(doc, first, length, self.eos_id)
            slots[offset : offset + length] = slot
            if masks is not None:
                masks[offset : offset + length] = self.shards.unit(doc, first, length, 0, mask=True)
        slots_t = torch.from_numpy(slots)
        example = packed_example(torch.from_numpy(tokens), slots_t, self.eos_id)
        if masks is not None:
            keep = packed_example(torch.from_numpy(masks), slots_t, 0)["labels"] == 1
            example["labels"] = torch.where(keep, example["labels"], IGNORE_INDEX)
        return example

    def _single(self, segment_5: np.ndarray) -> dict[str, torch.Tensor]:
        _, doc, first, take, _ = segment_5.tolist()
        tokens = np.full(self.seq_len + 1, self.eos_id, dtype=np.int64)
        tokens[:take] = self.shards.unit(doc, first, take, self.eos_id)
        labelled = np.arange(1, self.seq_len + 1) < take
        if self.shards.has_masks:
            mask = np.zeros(self.seq_len + 1, dtype=np.int64)
            mask[:take] = self.shards.unit(doc, first, take, 0, mask=True)
            labelled &= mask[1:] == 1
        t = torch.from_numpy(tokens)
        return {"input_ids": t[:-1].clone(), "labels": torch.where(torch.from_numpy(labelled), t[1:], IGNORE_INDEX)}
