"""A fast path for byte-level tokenizers: one table lookup per UTF-8 byte (numpy) instead of the tokenizer.

A byte-level tokenizer (e.g. ``ByT5Tokenizer``: id = byte + 3, EOS appended) spends most of its
time in Python per character; tokenizing gigabytes that way takes hours. :func:`byte_codec` finds
out whether a tokenizer is one, by asking the tokenizer itself:

1. every byte that UTF-8 can produce maps to one id: one probe character per lead and per
   continuation byte, each of which must encode (without special tokens) to exactly as many ids as
   it has bytes, consistently;
2. the special tokens it adds are a fixed prefix and suffix (from encoding ``"a"`` with and without
   them, checked against the empty text);
3. a mixed probe text (ASCII, repeated pairs that a merge would join, accents, CJK, emoji,
   whitespace runs) encodes the same both ways.

Any failure returns ``None`` and the tokenizer is used as is. A document that contains the first
character of one of the tokenizer's added tokens (e.g. ``<`` of ``</s>``) could hold that token,
which the tokenizer would match as a whole: :func:`encode_bytes` returns ``None`` for it and the
caller tokenizes that document with the tokenizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["ByteCodec", "byte_codec", "encode_byte_batch", "encode_bytes", "fast_path_bytes"]

_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. thththth aaaa  eeee\n\n\tZZ zz 0123456789 "
    "!?.,;:()[]{}\"'`~@#$%^&*-_=+|\\/"
    " héllo wörld ñ ç ß Æ — “quotes” 日本語のテキスト 한국어 🙂🚀 ÿ  trailing  "
)


class ByteCodec(NamedTuple):
    """How a byte-level tokenizer maps text: ``prefix + table[utf8 bytes] + suffix``."""

    table: np.ndarray  # int64 [256]; -1 for bytes UTF-8 never produces
    prefix: np.ndarray  # int64 ids the tokenizer adds before a text
    suffix: np.ndarray  # int64 ids it adds after
    special_starts: str  # first characters of the added tokens: a document holding one is tokenized as is


def _probe_chars() -> list[str]:
    seqs = [bytes([b]) for b in range(128)]
    seqs += [bytes([lead, 0x80]) for lead in range(0xC2, 0xE0)]
    seqs += [bytes([0xC2, cont]) for cont in range(0x80, 0xC0)]
    seqs += [bytes([lead, 0xA0 if lead == 0xE0 else 0x80, 0x80]) for lead in range(0xE0, 0xF0)]
    seqs += [bytes([lead, 0x90 if lead == 0xF0 else 0x80, 0x80, 0x80]) for lead in range(0xF0, 0xF5)]
    return [s.decode("utf-8") for s in seqs]


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _special_starts(tokenizer: Any) -> str:
    contents = [str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    contents += [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    return "".join(sorted({c[0] for c in contents if c}))


def byte_codec(tokenizer: Any) -> ByteCodec | None:
    """The :class:`ByteCodec` of ``tokenizer`` when it is byte-level (module doc), else ``None``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(backend, "normalizer", None) is not None:
        return None  # a normalizer may rewrite characters the probes do not cover
    table = np.full(256, -1, dtype=np.int64)
    try:
        for char in _probe_chars():
            raw = char.encode("utf-8")
            ids = _ids(tokenizer, char, False)
            if len(ids) != len(raw):
                return None
            for byte, token in zip(raw, ids):
                if table[byte] not in (-1, token):
                    return None
                table[byte] = token
        full, core = _ids(tokenizer, "a", True), _ids(tokenizer, "a", False)
        at = next((i for i in range(len(full) - len(core) + 1) if full[i : i + len(core)] == core), None)
        if at is None:
            return None
        codec = ByteCodec(table, np.array(full[:at], np.int64), np.array(full[at + len(core) :], np.int64),
                          _special_starts(tokenizer))  # fmt: skip
        probe = "".join(c for c in _PROBE_TEXT if c not in codec.special_starts)
        for text in ("", probe):
            fast = encode_bytes(codec, text)
            if fast is None or fast.tolist() != _ids(tokenizer, text, True):
                return None
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    return codec


def fast_path_bytes(codec: ByteCodec, text: str) -> bytes | None:
    """The UTF-8 bytes of ``text`` when the fast path applies to it; ``None`` when ``text`` holds an
    added token's first character or cannot be UTF-8 encoded (tokenize it as is)."""
    if any(c in text for c in codec.special_starts):
        return None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


def encode_bytes(codec: ByteCodec, text: str) -> np.ndarray | None:
    """The ids of ``text`` (int64, the tokenizer's special tokens included); ``None`` where
    :func:`fast_path_bytes` is ``None``."""
    raw_bytes = fast_path_bytes(codec, text)
    if raw_bytes is None:
        return None
    core = codec.table[np.frombuffer(raw_bytes, dtype=np.uint8)]
    if not (codec.prefix.size or codec.suffix.size):
        return core
    return np.concatenate([codec.prefix, core, codec.suffix])


def _offset_of(table: np.ndarray) -> int | None:
    """``k`` when every byte UTF-8 produces maps to ``byte + k``, else ``None``."""
    used = np.flatnonzero(table >= 0)
    offset = int(table[used[0]] - used[0])
    return offset if np.array_equal(table[used], used + offset) else None


def encode_byte_batch(codec: ByteCodec, texts: list[bytes], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, lengths)`` of several documents' UTF-8 bytes at once: their ids end to end in ``dtype``
    (each ``prefix + table[bytes] + suffix``) and each document's token count (int64)."""
    sizes = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    raw = np.frombuffer(b"".join(texts), dtype=np.uint8)
    offset = _offset_of(codec.table)
    if offset is not None and 0 <= offset and 255 + offset <= np.iinfo(dtype).max:
        core = raw.astype(dtype)  # id = byte + offset (e.g. ByT5): an add, cheaper than a lookup
        core += dtype.type(offset)
    else:
        core = codec.table.astype(dtype)[raw]
    p, q = codec.prefix.size, codec.suffix.size
    if p + q == 0:
        return core, sizes
    lengths = sizes + p + q
    ends = np.cumsum(sizes)
    # Document by document: its prefix at its first byte, its suffix after its last; the positions
    # never decrease in this order and np.insert keeps the order of equal positions (empty documents).
    at = np.concatenate([np.repeat((ends - sizes)[:, None], p, 1), np.repeat(ends[:, None], q, 1)], axis=1)
    values = np.tile(np.concatenate([codec.prefix, codec.suffix]), sizes.size)
    return np.insert(core, at.ravel(), values.astype(dtype)), lengths
