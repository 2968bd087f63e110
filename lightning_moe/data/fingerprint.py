"""Fingerprints that decide whether cached token shards still belong to their source and tokenizer.

* :func:`source_fingerprint`: every source file's resolved path, size and modification time (ns),
  plus the reading options (format, field, text unit, task, document cap). Editing, replacing,
  adding or removing a file changes it; the files are not read, so it is instant for any size.
  A saved ``datasets`` folder counts as the files inside it.
* :func:`tokenizer_fingerprint`: the tokenizer's class, its length and EOS id, and a SHA-256 over
  the tokenizer files of its folder (``tokenizer*``, ``vocab*``, ``merges*``, ``*.model``,
  ``special_tokens_map.json``, ``added_tokens.json``, ``chat_template*``); other files of a
  checkpoint folder (the weights) are not read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["source_fingerprint", "tokenizer_fingerprint"]

_TOKENIZER_PATTERNS = ("tokenizer*", "vocab*", "merges*", "*.model", "special_tokens_map.json", "added_tokens.json",
                       "chat_template*")  # fmt: skip
_HASH_CHUNK = 1 << 20


def _stat_entries(path: Path) -> list[list[Any]]:
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def source_fingerprint(files: Sequence[Path], options: dict[str, Any]) -> dict[str, Any]:
    """``{"fingerprint": sha256 hex, "files": count, "bytes": total size}`` of ``files`` read with ``options``."""
    entries = [e for f in files for e in _stat_entries(Path(f))]
    blob = json.dumps({"files": entries, "options": options}, sort_keys=True).encode()
    return {"fingerprint": hashlib.sha256(blob).hexdigest(), "files": len(entries),
            "bytes": sum(e[1] for e in entries)}  # fmt: skip


def tokenizer_fingerprint(tokenizer: Any, folder: str | Path) -> dict[str, Any]:
    """``{"class", "length", "eos_id", "sha256"}`` of ``tokenizer`` loaded from ``folder`` (module doc)."""
    digest = hashlib.sha256()
    root = Path(folder)
    names = sorted({f.name for pattern in _TOKENIZER_PATTERNS for f in root.glob(pattern) if f.is_file()})
    for name in names:
        digest.update(name.encode() + b"\0")
        with (root / name).open("rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {"class": type(tokenizer).__name__, "length": len(tokenizer), "eos_id": eos, "sha256": digest.hexdigest()}
