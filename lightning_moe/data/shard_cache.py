"""Tokenize a text source once into a token shard set under a cache folder, and reuse it while it matches.

:func:`ensure_token_shards` names the set after what it is made of (the resolved source paths, the
reading options, the task and the tokenizer folder: ``<cache_dir>/tokens-<hash>``) and records in
its header what it was made from (``fingerprint.py``: the files' sizes and modification times, the
tokenizer files' hash). A later run with the same inputs reuses the set when the header still
matches; otherwise (a source file or the tokenizer changed, a shard is truncated, an older format)
it warns with the reason and rebuilds. A set that was never completed (no header: a crash mid-write)
is built again as well.

Building streams: one record is read, tokenized and appended at a time (``shard_writer.py``).
Plain text through a byte-level tokenizer takes the numpy fast path (``byte_codec.py``), checked
against the tokenizer on documents 0, 1, 2, 4, 8, ...; on a mismatch the set is rebuilt with the
tokenizer itself (and a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_moe.data.byte_codec import ByteCodec, byte_codec, encode_byte_batch, encode_bytes, fast_path_bytes
from lightning_moe.data.fingerprint import source_fingerprint, tokenizer_fingerprint
from lightning_moe.data.sft import tokenize_chat
from lightning_moe.data.shard_format import check_shard_set, token_dtype
from lightning_moe.data.shard_writer import ShardWriter, remove_stale_partials
from lightning_moe.data.text import read_records
from lightning_moe.data.tokenizer import encode_text

__all__ = ["SHARD_TOKENS", "ShardSource", "ensure_token_shards", "where_of_document"]

log = logging.getLogger(__name__)

SHARD_TOKENS = 1 << 28  # tokens per shard: 512 MiB of uint16 ids
_CHECK_MAX_CHARS = 1 << 16  # fast-path checks skip longer documents (the tokenizer is slow on them)
_BATCH_BYTES = 1 << 22  # fast-path documents are converted and written in batches of about 4 MiB


@dataclass(frozen=True)
class ShardSource:
    """What a shard set is read from: the files (as ``text.expand_paths`` lists them) and how."""

    files: tuple[str, ...]
    format: str
    field: str
    text_unit: str
    task: str
    max_documents: int | None

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "files"}


class _FastPathMismatch(Exception):
    pass


def _hash16(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _encode(tokenizer: Any, task: str, value: Any, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    if task == "sft":
        ids, mask = tokenize_chat(tokenizer, value, where)
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)
    return np.asarray(encode_text(tokenizer, value, where), dtype=np.int64), None


class _ByteBatch:
    """Documents on the byte fast path, written together once they hold ``_BATCH_BYTES`` bytes."""

    def __init__(self, codec: ByteCodec, writer: ShardWriter) -> None:
        self.codec, self.writer = codec, writer
        self.texts: list[bytes] = []
        self.size = 0
        self.where = ""

    def add(self, raw: bytes, where: str) -> None:
        self.where = self.where or where
        self.texts.append(raw)
        self.size += len(raw)
        if self.size >= _BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.texts:
            ids, lengths = encode_byte_batch(self.codec, self.texts, self.writer.dtype)
            self.writer.add_batch(ids, lengths, where=f"the documents from {self.where} on")
        self.texts, self.size, self.where = [], 0, ""


def _build(folder: Path, source: ShardSource, tokenizer: Any, codec: ByteCodec | None, header: dict[str, Any],
           shard_tokens: int, owner: str) -> None:  # fmt: skip
    vocab = len(tokenizer)
    records = read_records(list(source.files), source.format, source.field, source.text_unit)  # type: ignore[arg-type]
    with ShardWriter(folder, vocab, token_dtype(vocab, owner), source.task == "sft", shard_tokens) as writer:
        batch = _ByteBatch(codec, writer) if codec is not None else None
        for n, (value, where) in enumerate(records):
            if source.max_documents is not None and n >= source.max_documents:
                break
            raw = fast_path_bytes(codec, value) if codec is not None and isinstance(value, str) else None
            if batch is not None and raw is not None:
                if n & (n - 1) == 0 and len(value) <= _CHECK_MAX_CHARS:  # documents 0, 1, 2, 4, 8, ...
                    fast = encode_bytes(codec, value)  # type: ignore[arg-type]
                    if fast is None or fast.tolist() != encode_text(tokenizer, value, where):
                        raise _FastPathMismatch(where)
                batch.add(raw, where)
                continue
            if batch is not None:
                batch.flush()  # keep the documents in order
            ids, mask = _encode(tokenizer, source.task, value, where)
            writer.add(ids, mask, where)
        if batch is not None:
            batch.flush()
        writer.install({**header, "fast_path": "bytes" if codec is not None else None})


def ensure_token_shards(cache_dir: str | Path, source: ShardSource, tokenizer: Any, tokenizer_dir: str | Path,
                        owner: str = "ensure_token_shards", shard_tokens: int = SHARD_TOKENS) -> Path:  # fmt: skip
    """The folder of a complete shard set of ``source`` tokenized by ``tokenizer`` (module doc)."""
    files = [Path(f) for f in source.files]
    identity = {"files": [str(f.resolve()) for f in files], "options": source.options(),
                "tokenizer_dir": str(Path(tokenizer_dir).resolve())}  # fmt: skip
    folder = Path(cache_dir) / f"tokens-{_hash16(identity)}"
    header = {"source": source_fingerprint(files, source.options()),
              "tokenizer": tokenizer_fingerprint(tokenizer, tokenizer_dir)}  # fmt: skip
    problem = check_shard_set(folder, header)
    if problem is None:
        log.info("%s: reusing the token shards in %s", owner, folder)
        return folder
    if folder.exists():
        warnings.warn(f"{owner}: rebuilding the token shards in {folder}: {problem}.", stacklevel=2)
    remove_stale_partials(folder)
    codec = byte_codec(tokenizer) if source.task == "lm" else None
    log.info("%s: tokenizing %d file(s) into %s%s", owner, len(files), folder, " (byte fast path)" if codec else "")
    try:
        _build(folder, source, tokenizer, codec, header, shard_tokens, owner)
    except _FastPathMismatch as exc:
        warnings.warn(f"{owner}: the byte-level fast path disagrees with the tokenizer at {exc}; tokenizing "
                      "with the tokenizer itself (slower).", stacklevel=2)  # fmt: skip
        _build(folder, source, tokenizer, None, header, shard_tokens, owner)
    return folder


def where_of_document(source: ShardSource, index: int) -> str:
    """``"<file>:<line>"`` (or ``"<file>:row <n>"``) of document ``index`` of ``source``, by reading up to it."""
    records = read_records(list(source.files), source.format, source.field, source.text_unit)  # type: ignore[arg-type]
    for n, record in enumerate(records):
        if n == index:
            return record.where
    return f"document {index}"
