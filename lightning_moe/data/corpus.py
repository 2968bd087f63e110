"""Token streams: the embedded default corpus (the stdlib's source), text files, folders, ``.npy``.

The default corpus needs no download: it is the Python standard library's own ``.py`` source,
read from the running interpreter (``sysconfig.get_paths()["stdlib"]``). Tokens are raw bytes,
so the vocabulary is fixed at ``VOCAB_SIZE = 256`` and no tokenizer is involved.

Files are read in a fixed order (sorted by relative path, joined by ``SEPARATOR``), so a given
interpreter and path always give the same stream; ``max_bytes`` caps it.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["SEPARATOR", "TEXT_SUFFIXES", "VOCAB_SIZE", "load_tokens", "missing_path", "stdlib_corpus", "stdlib_files"]

VOCAB_SIZE = 256
# NUL never occurs in Python or ordinary text, so it marks file boundaries unambiguously.
SEPARATOR = b"\x00"
TEXT_SUFFIXES = (".txt", ".md", ".py")
# Tests, IDLE and lib2to3 are large and repetitive (fixtures, grammar tables); site-packages
# depends on what happens to be installed, which would break determinism across machines.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def missing_path(path: str) -> ValueError:
    fix = "pass an existing file, folder or .npy, or None for the stdlib corpus"
    return ValueError(f"MoEDataModule: path={path!r} does not exist; {fix}.")


def _sorted_files(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by POSIX relative path.

    Pruning during ``os.walk`` (rather than filtering ``rglob``) keeps a walk of the stdlib from
    descending into a large ``site-packages``. Hidden folders (``.git``, ``.venv``) are skipped.
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _join_files(files: list[Path], max_bytes: int | None) -> bytes:
    """Concatenate ``files`` with ``SEPARATOR``, reading no more files than ``max_bytes`` needs."""
    parts: list[bytes] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        parts.append(f.read_bytes() + SEPARATOR)
        total += len(parts[-1])
    return b"".join(parts)[:max_bytes]


def stdlib_files() -> list[Path]:
    """The stdlib ``.py`` files of the running interpreter, sorted by relative path.

    Skips ``site-packages``, ``test``/``tests``, ``idlelib``, ``lib2to3`` and ``__pycache__``,
    plus the build-generated ``_sysconfigdata*.py`` and ``config-*`` folder, whose contents are
    machine-specific build paths rather than source.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _STDLIB_SKIP_DIRS | {d.name for d in root.glob("config-*")}
    return [p for p in _sorted_files(root, (".py",), skip) if not p.name.startswith("_sysconfigdata")]


def stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """The embedded default corpus: ``stdlib_files()`` joined by ``SEPARATOR``.

    ``max_bytes=None`` returns all of it (about 10 MB on CPython 3.11); otherwise the first
    ``max_bytes`` bytes. Raises ``RuntimeError`` if the interpreter ships no stdlib source
    (e.g. an embedded build with a zipped stdlib).
    """
    if not (files := stdlib_files()):
        raise RuntimeError(
            f"stdlib_corpus: no .py files under stdlib={sysconfig.get_paths()['stdlib']!r} (zipped or stripped "
            "stdlib); pass path=<text file, folder or .npy> to MoEDataModule instead."
        )
    return _join_files(files, max_bytes)


def _load_npy(path: Path, max_bytes: int | None) -> torch.Tensor:
    import numpy as np  # lazily: only the .npy input needs numpy

    # mmap so that a large file capped by max_bytes is never read whole.
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(
            f"MoEDataModule: path={str(path)!r} has shape {arr.shape} and dtype {arr.dtype}; "
            "save a 1-D integer array (arr.reshape(-1).astype(np.int64))."
        )
    return torch.from_numpy(np.array(arr[:max_bytes], dtype=np.int64))


def _read(path: str | None, max_bytes: int | None) -> torch.Tensor:
    if path is None:
        data = stdlib_corpus(max_bytes)
    else:
        p = Path(path)
        if not p.exists():
            raise missing_path(path)
        if p.is_file() and p.suffix == ".npy":
            return _load_npy(p, max_bytes)
        if p.is_dir():
            files = _sorted_files(p, TEXT_SUFFIXES, frozenset({"__pycache__"}))
            if not files:
                kinds = "/".join(TEXT_SUFFIXES)
                raise ValueError(f"MoEDataModule: path={path!r} is a folder with no {kinds} files; add text files.")
            data = _join_files(files, max_bytes)
            data = data if data.strip(SEPARATOR) else b""  # only empty files: as empty as an empty file
        else:
            with p.open("rb") as f:
                data = f.read(-1 if max_bytes is None else max_bytes)
    # frombuffer rejects an empty buffer; load_tokens reports emptiness with the path instead.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_tokens(path: str | None = None, max_bytes: int | None = None, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Read a token stream as a 1-D tensor: uint8 when ``vocab_size <= 256``, else int64.

    ``path=None``: the stdlib corpus. A ``.npy`` file: pre-tokenized ids in ``[0, vocab_size)``.
    Any other file: its bytes. A folder: every ``*.txt``/``*.md``/``*.py`` below it, sorted by
    relative path and joined by ``SEPARATOR``. ``max_bytes`` caps the number of tokens (one token
    per byte for text). Raises ``ValueError`` naming ``path`` when it is missing, empty, or has
    ids outside ``[0, vocab_size)``.
    """
    tokens = _read(path, max_bytes)
    if tokens.numel() == 0:
        raise ValueError(f"MoEDataModule: path={path!r} holds no tokens (empty file(s)); supply some text or ids.")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"MoEDataModule: path={path!r} has token ids in [{lo}, {hi}], outside [0, vocab_size={vocab_size}); "
            f"set vocab_size >= {hi + 1} (byte-level text needs {VOCAB_SIZE}) or re-tokenize."
        )
    # One byte per token keeps a byte-level corpus at its size on disk.
    return tokens.to(torch.uint8) if vocab_size <= 256 else tokens.long()
