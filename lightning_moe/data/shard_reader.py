"""Read a token shard set (``shard_format.py``) in constant memory.

The shard files are plain arrays (``numpy.memmap`` opens them as they are). :class:`TokenShards`
reads them with positional reads (``os.pread`` through :class:`ArrayFile`) of just the bytes a row
needs, and finds document ``k`` of the set by the shards' document counts and the ``ends`` index.
Positional reads rather than maps: every page a map touches (and the neighbours the kernel maps
with it, 64 KiB a fault) stays in the process's resident memory until the map is closed, so random
rows over a map grow the resident set with the corpus; a read leaves only the operating system's
page cache, which it drops at will. Whole-set passes (:meth:`~TokenShards.lengths`) read the
``ends`` files in chunks. Files are opened on first use in each process (``DataLoader`` workers
open their own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_moe.data.shard_format import read_header, shard_file

__all__ = ["ArrayFile", "TokenShards"]

_LENGTHS_CHUNK = 1 << 20


class ArrayFile:
    """A file holding one flat array of ``dtype``, read ``count`` items at ``first`` by ``os.pread``."""

    def __init__(self, path: str | Path, dtype: np.dtype | str) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # each process opens the file itself

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]

    def read(self, first: int, count: int) -> np.ndarray:
        """Items ``first .. first + count`` (a read-only array); ``IndexError`` past the end of the file."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, first * size)
        if len(data) != count * size:
            raise IndexError(f"ArrayFile: items {first}..{first + count} are past the end of {self.path}")
        return np.frombuffer(data, dtype=self.dtype)


class TokenShards:
    """The documents of the shard set in ``folder`` (a complete one: ``check_shard_set`` first)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        header = read_header(self.folder)
        if header is None:
            raise ValueError(f"TokenShards: {self.folder} holds no header.json; build the shard set first.")
        self.header = header
        self.dtype = np.dtype(header["dtype"])
        self.has_masks: bool = header["has_masks"]
        self.documents: int = header["documents"]
        self.tokens: int = header["tokens"]
        counts = [s["documents"] for s in header["shards"]]
        self._first_doc = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # [shards + 1]
        kinds = {"tokens": self.dtype, "ends": np.dtype("<i8")}
        if self.has_masks:
            kinds["masks"] = np.dtype(np.uint8)
        self._files = [{k: ArrayFile(self.folder / shard_file(k, i), d) for k, d in kinds.items()}
                       for i in range(len(counts))]  # fmt: skip

    def _locate(self, doc: int) -> tuple[dict[str, ArrayFile], int, int]:
        if not 0 <= doc < self.documents:
            raise IndexError(f"TokenShards: document {doc} out of range for {self.documents} documents")
        shard = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        files = self._files[shard]
        local = doc - int(self._first_doc[shard])
        if local == 0:
            return files, 0, int(files["ends"].read(0, 1)[0])
        start, end = files["ends"].read(local - 1, 2).tolist()
        return files, start, end

    def __len__(self) -> int:
        return self.documents

    def document(self, doc: int) -> np.ndarray:
        """Token ids of document ``doc`` (read-only)."""
        files, start, end = self._locate(doc)
        return files["tokens"].read(start, end - start)

    def mask(self, doc: int) -> np.ndarray:
        """The 0/1 loss mask of document ``doc`` (chats only)."""
        if not self.has_masks:
            raise ValueError(f"TokenShards: {self.folder} holds no masks (written for plain text).")
        files, start, end = self._locate(doc)
        return files["masks"].read(start, end - start)

    def unit(self, doc: int, first: int, count: int, eos_id: int, mask: bool = False) -> np.ndarray:
        """int64 ``[count]``: positions ``first .. first + count`` of document ``doc`` followed by its EOS
        (position ``len(doc)`` is ``eos_id``; for ``mask=True`` the mask, with 0 at the EOS)."""
        files, start, end = self._locate(doc)
        n = end - start
        take = min(first + count, n)
        body = files["masks" if mask else "tokens"].read(start + first, max(take - first, 0)).astype(np.int64)
        if first + count <= n:
            return body
        return np.concatenate([body, np.array([0 if mask else eos_id], dtype=np.int64)])

    def lengths(self) -> Iterator[np.ndarray]:
        """Token counts of the documents in order (int64 chunks), read without mapping the files."""
        for index in range(len(self._first_doc) - 1):
            path = self.folder / shard_file("ends", index)
            total = int(self._first_doc[index + 1] - self._first_doc[index])
            previous = 0
            for at in range(0, total, _LENGTHS_CHUNK):
                ends = np.fromfile(path, dtype="<i8", count=min(_LENGTHS_CHUNK, total - at), offset=at * 8)
                yield np.diff(ends, prepend=previous)
                previous = int(ends[-1])
