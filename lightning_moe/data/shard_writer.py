"""Write a token shard set (``shard_format.py``) in constant memory, atomically.

:class:`ShardWriter` takes one document at a time (:meth:`~ShardWriter.add`) and appends it to the
open shard's files, closing that shard once it holds ``shard_tokens`` tokens or more. Everything
is written under a temporary folder next to the target (``.<name>.tmp-<host>-<pid>-<random>``),
each shard's files under a ``.partial`` name until the shard is closed and synced. Only
:meth:`~ShardWriter.install` writes ``header.json`` and renames the folder to its target name, so a
crash at any point leaves either the old set or none, never a set that looks complete; the
temporary folders of dead writers are removed by :func:`remove_stale_partials`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from lightning_moe.data.shard_format import FORMAT_NAME, FORMAT_VERSION, HEADER_NAME, shard_file
from lightning_moe.resources import pid_alive

__all__ = ["ShardWriter", "install_folder", "remove_stale_partials", "temp_folder", "write_json_atomic"]

_ENDS_BUFFER = 1 << 16


def _temp_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temp_folder(target: Path) -> Path:
    """A new empty temporary folder next to ``target`` (``.<name>.tmp-<host>-<pid>-<random>``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_name(target, "tmp")
    temp.mkdir()
    return temp


def install_folder(temp: Path, target: Path) -> None:
    """Rename the finished folder ``temp`` to ``target``, replacing an older ``target``; when another
    process installed ``target`` meanwhile, theirs is kept and ``temp`` removed."""
    old = None
    if target.exists():
        old = _temp_name(target, "old")
        os.rename(target, old)
    try:
        os.rename(temp, target)
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` as JSON to ``path`` through a synced ``.partial`` file and a rename."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the temporary folders next to ``target`` left by writers of this host that died; return them."""
    host = socket.gethostname()
    removed = []
    for path in target.parent.glob(f".{target.name}.*-{host}-*"):
        pid_text = path.name.rsplit("-", 2)[-2]
        if path.is_dir() and pid_text.isdigit() and not pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class ShardWriter:
    """Stream documents into a new shard set for ``target`` (module doc); a context manager that
    discards its temporary folder when the block raises.

    Args:
        target: the folder the finished set is renamed to (replacing an older one there).
        vocab_size: ids must be in ``[0, vocab_size)``; picks the dtype (``token_dtype``).
        dtype: uint16 or uint32 (``token_dtype(vocab_size)``).
        has_masks: documents come with a uint8 loss mask (chats).
        shard_tokens: a shard is closed after the document that brings it to this many tokens.
    """

    def __init__(self, target: Path, vocab_size: int, dtype: np.dtype, has_masks: bool, shard_tokens: int) -> None:
        if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
            raise ValueError(f"ShardWriter: shard_tokens={shard_tokens!r} must be a positive int.")
        self.target = Path(target)
        self.vocab_size, self.dtype = vocab_size, np.dtype(dtype)
        self.has_masks, self.shard_tokens = has_masks, shard_tokens
        self.temp = temp_folder(self.target)
        self.shards: list[dict[str, int]] = []
        self.documents = 0
        self.tokens = 0
        self._files: dict[str, BinaryIO] = {}
        self._ends: list[np.ndarray] = []
        self._ends_count = 0
        self._shard_tokens = 0
        self._shard_documents = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.discard()

    def _partial(self, kind: str) -> Path:
        return self.temp / (shard_file(kind, len(self.shards)) + ".partial")

    def _open_shard(self) -> None:
        kinds = ("tokens", "ends", "masks") if self.has_masks else ("tokens", "ends")
        self._files = {kind: self._partial(kind).open("wb") for kind in kinds}

    def _flush_ends(self) -> None:
        if self._ends:
            self._files["ends"].write(np.concatenate(self._ends).astype("<i8").tobytes())
            self._ends, self._ends_count = [], 0

    def _close_shard(self) -> None:
        self._flush_ends()
        for kind, fh in self._files.items():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(self._partial(kind), self.temp / shard_file(kind, len(self.shards)))
        self.shards.append({"documents": self._shard_documents, "tokens": self._shard_tokens})
        self._files, self._shard_tokens, self._shard_documents = {}, 0, 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, where: str = "") -> None:
        """Append one document: its token ids (1-D integers) and, with ``has_masks``, its 0/1 mask."""
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"ShardWriter: {where}: the mask has {mask.shape} entries for {ids.shape} token ids.")
        self.add_batch(ids, np.asarray([ids.size], dtype=np.int64), mask, where)

    def add_batch(self, ids: np.ndarray, lengths: np.ndarray, masks: np.ndarray | None = None, where: str = "") -> None:
        """Append documents given end to end: ``ids`` 1-D, ``lengths`` their token counts (and with
        ``has_masks`` their masks end to end); ``where`` names them in errors."""
        at = f"{where}: " if where else ""
        low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"ShardWriter: {at}token id {low if low < 0 else high} is outside the vocabulary "
                f"[0, {self.vocab_size}); vocab_size must be the tokenizer's length (len(tokenizer)), which "
                "covers every id it makes."
            )
        if self.has_masks != (masks is not None) or int(lengths.sum()) != ids.size:
            raise ValueError(f"ShardWriter: {at}lengths must add up to the ids, with masks exactly when has_masks.")
        ids = ids.astype(self.dtype, copy=False)
        first, pos = 0, 0
        while first < lengths.size:
            if not self._files:
                self._open_shard()
            cum = np.cumsum(lengths[first:])
            take = min(int(np.searchsorted(cum, self.shard_tokens - self._shard_tokens)) + 1, cum.size)
            count = int(cum[take - 1])
            self._files["tokens"].write(memoryview(ids[pos : pos + count]).cast("B"))
            if masks is not None:
                self._files["masks"].write(masks[pos : pos + count].astype(np.uint8, copy=False).tobytes())
            self._ends.append(self._shard_tokens + cum[:take])
            self._ends_count += take
            self._shard_tokens += count
            self._shard_documents += take
            self.documents += take
            self.tokens += count
            first, pos = first + take, pos + count
            if self._ends_count >= _ENDS_BUFFER:
                self._flush_ends()
            if self._shard_tokens >= self.shard_tokens:
                self._close_shard()

    def install(self, header: dict[str, Any]) -> Path:
        """Close the last shard, write ``header.json`` (``header`` plus the counts and the shard list)
        and rename the set to ``target``. Returns ``target``."""
        if self._files:
            self._close_shard()
        full = {**header, "format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": self.dtype.str,
                "vocab_size": self.vocab_size, "has_masks": self.has_masks, "documents": self.documents,
                "tokens": self.tokens, "shards": self.shards}  # fmt: skip
        write_json_atomic(self.temp / HEADER_NAME, full)
        install_folder(self.temp, self.target)
        return self.target

    def discard(self) -> None:
        """Close and remove the temporary folder (nothing is installed)."""
        for fh in self._files.values():
            fh.close()
        self._files = {}
        shutil.rmtree(self.temp, ignore_errors=True)
