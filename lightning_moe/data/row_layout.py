"""Where every row's tokens come from in a token shard set: computed in one streaming pass, stored on disk.

Legend: R rows, G segments (a run of consecutive tokens of one document in one row).

:func:`build_row_layout` reads the documents' lengths (never their tokens) in order and lays the
rows out exactly as ``TextDataModule`` does in memory: the held-out split drawn per document from
``random.Random(seed)``, packing in runs of about ``pack_chunk_tokens`` tokens with
``packing.layout_units`` (next fit, an EOS after each document, ``long_documents``), or one document per
row. Each split's layout is two files of a folder (written under a temporary name, renamed when
complete, like the shards)::

    <split>-rows.bin       int64 [R + 1]: row r is segments rows[r] .. rows[r + 1] - 1
    <split>-segments.bin   int64 [G, 5]: (offset in the row, document, first position in the
                           document + its EOS, length, document slot in the row)
    layout.json            per split: rows, segments, documents, long documents and the first one

so row ``r`` is read with two small slices (``shard_rows.py``) and nothing grows with the corpus.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lightning_moe.data.packing import layout_units
from lightning_moe.data.shard_reader import TokenShards
from lightning_moe.data.shard_writer import install_folder, temp_folder, write_json_atomic

__all__ = ["LAYOUT_NAME", "LayoutSpec", "build_row_layout", "layout_files"]

LAYOUT_NAME = "layout.json"
SEGMENT_FIELDS = 5
_FLUSH_SEGMENTS = 1 << 16


@dataclass(frozen=True)
class LayoutSpec:
    """How rows are cut: the ``TextDataModule`` arguments that decide the layout."""

    seq_len: int
    packing: str
    long_documents: str
    pack_chunk_tokens: int


def layout_files(folder: Path, split: str) -> tuple[Path, Path]:
    """``(<split>-rows.bin, <split>-segments.bin)`` of a layout folder."""
    return folder / f"{split}-rows.bin", folder / f"{split}-segments.bin"


class _SplitRows:
    """The rows of one split, laid out document by document and streamed to its two files."""

    def __init__(self, folder: Path, split: str, spec: LayoutSpec) -> None:
        self.spec = spec
        rows_path, segments_path = layout_files(folder, split)
        self._rows_file: BinaryIO = rows_path.open("wb")
        self._segments_file: BinaryIO = segments_path.open("wb")
        self.rows = 0
        self.segments = 0
        self.documents = 0
        self.long = 0
        self.first_long: int | None = None
        self._chunk_docs: list[int] = []
        self._chunk_lengths: list[int] = []
        self._chunk_tokens = 0

    def add(self, doc: int, length: int) -> None:
        """Lay out document ``doc`` of ``length`` tokens (its EOS not counted)."""
        self.documents += 1
        if length > self.spec.seq_len:
            self.long += 1
            self.first_long = doc if self.first_long is None else self.first_long
        if self.long and self.spec.long_documents == "error":
            return  # the caller refuses the data; nothing more to lay out
        self._chunk_docs.append(doc)
        self._chunk_lengths.append(length)
        self._chunk_tokens += length
        if self._chunk_tokens >= self.spec.pack_chunk_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._chunk_docs:
            return
        if self.spec.packing == "pack":
            segments, rows = self._packed()
        else:
            segments, rows = self._one_per_row()
        if segments.shape[0]:
            counts = np.bincount(segments[:, 0], minlength=rows)
            firsts = self.segments + np.cumsum(counts) - counts
            self._rows_file.write(firsts.astype("<i8").tobytes())
            self._segments_file.write(np.ascontiguousarray(segments[:, 1:], dtype="<i8").tobytes())
            self.rows += rows
            self.segments += segments.shape[0]
        self._chunk_docs, self._chunk_lengths, self._chunk_tokens = [], [], 0

    def _packed(self) -> tuple[np.ndarray, int]:
        units = np.asarray(self._chunk_lengths, dtype=np.int64) + 1  # each document and its EOS
        starts = np.cumsum(units) - units
        placed, rows = layout_units(starts.tolist(), units.tolist(), self.spec.seq_len + 1, self.spec.long_documents,
                               "TextDataModule")  # fmt: skip
        if not placed:
            return np.empty((0, SEGMENT_FIELDS + 1), dtype=np.int64), 0
        row, offset, src, length, slot = np.asarray(placed, dtype=np.int64).T
        unit = np.searchsorted(starts, src, side="right") - 1
        docs = np.asarray(self._chunk_docs, dtype=np.int64)[unit]
        return np.stack([row, offset, docs, src - starts[unit], length, slot], axis=1), rows

    def _one_per_row(self) -> tuple[np.ndarray, int]:
        seq_len, out = self.spec.seq_len, []
        for doc, n in zip(self._chunk_docs, self._chunk_lengths):
            if n == 0:  # an empty document: no label, no row
                continue
            if n + 1 <= seq_len + 1 or self.spec.long_documents == "truncate":
                out.append((doc, 0, min(n + 1, seq_len + 1)))
                continue
            out.extend((doc, first, min(seq_len + 1, n + 1 - first)) for first in range(0, n, seq_len))
        if not out:
            return np.empty((0, SEGMENT_FIELDS + 1), dtype=np.int64), 0
        doc, first, take = np.asarray(out, dtype=np.int64).T
        zeros = np.zeros_like(doc)
        return np.stack([np.arange(len(out)), zeros, doc, first, take, zeros], axis=1), len(out)

    def close(self) -> dict[str, Any]:
        self._flush()
        self._rows_file.write(np.asarray([self.segments], dtype="<i8").tobytes())
        for fh in (self._rows_file, self._segments_file):
            fh.close()
        return {"rows": self.rows, "segments": self.segments, "documents": self.documents, "long": self.long,
                "first_long": self.first_long}  # fmt: skip


def build_row_layout(target: Path, spec: LayoutSpec, splits: dict[str, TokenShards],
                     held_out: tuple[int, float] | None) -> dict[str, Any]:  # fmt: skip
    """Lay out the rows of each split in ``splits`` into the folder ``target`` (module doc).

    ``splits`` maps a split name to its documents. With ``held_out=(seed, val_fraction)`` there is
    one shard set (``splits["train"]``) and each of its documents goes to ``"validation"`` with
    probability ``val_fraction``, drawn in order from ``random.Random(seed)``. Returns the content
    of ``layout.json`` (per split: rows, segments, documents, long, first_long).
    """
    temp = temp_folder(target)
    try:
        names = ("train", "validation") if held_out is not None else tuple(splits)
        writers = {name: _SplitRows(temp, name, spec) for name in names}
        if held_out is not None:
            draw, fraction = random.Random(held_out[0]), held_out[1]
            doc = 0
            for lengths in splits["train"].lengths():
                for n in lengths.tolist():
                    writers["validation" if draw.random() < fraction else "train"].add(doc, n)
                    doc += 1
        else:
            for name, shards in splits.items():
                doc = 0
                for lengths in shards.lengths():
                    for n in lengths.tolist():
                        writers[name].add(doc, n)
                        doc += 1
        summary = {name: w.close() for name, w in writers.items()}
        write_json_atomic(temp / LAYOUT_NAME, summary)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    install_folder(temp, target)
    return summary
