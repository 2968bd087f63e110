"""Read a token shard set (``shard_format.py``) in constant memory.

:class:`TokenShards` maps each shard's files with ``numpy.memmap`` (read-only, opened on first use
in each process, so a ``DataLoader`` worker opens its own) and finds document ``k`` of the set by
the shards' document counts and the ``ends`` index. Whole-set passes (:meth:`~TokenShards.lengths`)
read the ``ends`` files in chunks with plain reads instead of the maps, so they leave no mapped
pages behind. Only the pages a row touches are read; the operating system may drop them at will.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_moe.data.shard_format import read_header, shard_file

__all__ = ["TokenShards"]

_LENGTHS_CHUNK = 1 << 20


def _map(path: Path, dtype: np.dtype | str) -> np.ndarray:
    if path.stat().st_size == 0:  # mmap refuses an empty file
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


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
        self._maps: list[dict[str, np.ndarray]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}  # each process maps the files itself

    def _shard_maps(self) -> list[dict[str, np.ndarray]]:
        if self._maps is None:
            kinds = {"tokens": self.dtype, "ends": np.dtype("<i8")}
            if self.has_masks:
                kinds["masks"] = np.dtype(np.uint8)
            self._maps = [{k: _map(self.folder / shard_file(k, i), d) for k, d in kinds.items()}
                          for i in range(len(self._first_doc) - 1)]  # fmt: skip
        return self._maps

    def _locate(self, doc: int) -> tuple[dict[str, np.ndarray], int, int]:
        if not 0 <= doc < self.documents:
            raise IndexError(f"TokenShards: document {doc} out of range for {self.documents} documents")
        shard = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        maps = self._shard_maps()[shard]
        local = doc - int(self._first_doc[shard])
        start = int(maps["ends"][local - 1]) if local else 0
        return maps, start, int(maps["ends"][local])

    def __len__(self) -> int:
        return self.documents

    def document(self, doc: int) -> np.ndarray:
        """Token ids of document ``doc`` (a read-only view into the map)."""
        maps, start, end = self._locate(doc)
        return maps["tokens"][start:end]

    def mask(self, doc: int) -> np.ndarray:
        """The 0/1 loss mask of document ``doc`` (chats only)."""
        if not self.has_masks:
            raise ValueError(f"TokenShards: {self.folder} holds no masks (written for plain text).")
        maps, start, end = self._locate(doc)
        return maps["masks"][start:end]

    def unit(self, doc: int, first: int, count: int, eos_id: int, mask: bool = False) -> np.ndarray:
        """int64 ``[count]``: positions ``first .. first + count`` of document ``doc`` followed by its EOS
        (position ``len(doc)`` is ``eos_id``; for ``mask=True`` the mask, with 0 at the EOS)."""
        maps, start, end = self._locate(doc)
        n = end - start
        take = min(first + count, n)
        body = maps["masks" if mask else "tokens"][start + first : start + take].astype(np.int64)
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
