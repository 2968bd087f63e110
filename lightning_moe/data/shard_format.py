"""The on-disk format of tokenized text: token shards (raw arrays, ``numpy.memmap``-able) and their JSON header.

Legend: N documents of a shard, T tokens of a shard.

A shard set is one folder (``docs/data.md`` shows it)::

    header.json          written last: the set is complete only when it exists and matches the files
    tokens-00000.bin     token ids of shard 0, documents end to end, no EOS between them: uint16 [T]
                         when the vocabulary has <= 65535 ids, else uint32 (little-endian)
    ends-00000.bin       int64 [N]: where each document of shard 0 ends in its tokens file
                         (document k is tokens[ends[k - 1]:ends[k]], ends[-1] = 0)
    masks-00000.bin      uint8 [T], chats only: 1 on the assistant's tokens (the loss mask)
    tokens-00001.bin ... the next shard: a shard is closed after the document that takes it past
                         the size limit, so no document spans two shards

Documents are numbered over the whole set in reading order (record ``k`` of the source is
document ``k``, an empty one included), so the held-out split drawn per record lands on the same
documents as in memory. :func:`check_shard_set` says why a folder is not a usable set (``None``
when it is).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADER_NAME",
    "check_shard_set",
    "read_header",
    "shard_file",
    "token_dtype",
]

FORMAT_NAME = "lightning-moe-token-shards"
FORMAT_VERSION = 1
HEADER_NAME = "header.json"
_UINT16_IDS = 1 << 16  # ids 0 .. 65535
_UINT32_IDS = 1 << 32


def token_dtype(vocab_size: int, owner: str = "token_dtype") -> np.dtype:
    """uint16 when every id of a ``vocab_size`` vocabulary fits (<= 65535), else uint32.

    Raises ``ValueError`` for a vocabulary that is not a positive int or holds more ids than uint32.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{owner}: vocab_size={vocab_size!r} must be a positive int (len(tokenizer)).")
    if vocab_size <= _UINT16_IDS - 1:
        return np.dtype("<u2")
    if vocab_size <= _UINT32_IDS - 1:
        return np.dtype("<u4")
    raise ValueError(
        f"{owner}: vocab_size={vocab_size} has ids beyond uint32 (at most {_UINT32_IDS - 1} ids); "
        "token shards store uint16 or uint32 ids, so use a smaller vocabulary."
    )


def shard_file(kind: str, index: int) -> str:
    """``"tokens-00003.bin"`` for ``kind="tokens"``, ``index=3`` (kinds: tokens, ends, masks)."""
    return f"{kind}-{index:05d}.bin"


def read_header(folder: Path) -> dict[str, Any] | None:
    """The parsed ``header.json`` of ``folder``; ``None`` when it is missing or not valid JSON."""
    try:
        return json.loads((folder / HEADER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_shard_set(folder: Path, expected: dict[str, Any]) -> str | None:
    """Why ``folder`` is not a complete shard set made from ``expected``'s source and tokenizer.

    ``expected`` holds the header keys that must match (``"source"``, ``"tokenizer"``, ...).
    Returns ``None`` when the set is usable, else one line naming the first problem: no header,
    another format version, a changed source or tokenizer, a missing or truncated shard file.
    """
    header = read_header(folder)
    if header is None:
        return f"{folder} holds no complete header ({HEADER_NAME} missing or unreadable)"
    if header.get("format") != FORMAT_NAME or header.get("version") != FORMAT_VERSION:
        return f"{folder} is format {header.get('format')!r} version {header.get('version')!r}, not {FORMAT_VERSION}"
    for key, want in expected.items():
        if header.get(key) != want:
            return f"the {key} changed since the shards were written ({header.get(key)!r} -> {want!r})"
    itemsize = np.dtype(header["dtype"]).itemsize
    for index, shard in enumerate(header["shards"]):
        sizes = {"tokens": shard["tokens"] * itemsize, "ends": shard["documents"] * 8}
        if header["has_masks"]:
            sizes["masks"] = shard["tokens"]
        for kind, size in sizes.items():
            path = folder / shard_file(kind, index)
            if not path.is_file() or path.stat().st_size != size:
                got = path.stat().st_size if path.is_file() else "missing"
                return f"{path} is {got} bytes, the header says {size}"
    return None
