"""Publish a checkpoint only when it is complete.

A checkpoint (a DCP folder or one file) is written under :func:`staging_path`, a hidden sibling
that no "last"/top-k lookup matches, its files are fsynced, and :func:`publish` renames it into
place. Renames within one filesystem are atomic, so a reader sees the old checkpoint or the new
one, never a mix. A folder that replaces an older one of the same name (``last.ckpt``) is swapped
with it in one step (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one, now under the staging
name, is deleted after; where the exchange is not available the old one is moved aside first
(:func:`retired_path`), and a crash between the two renames leaves it under its retired name, which
:func:`recover` (called by every save and by :func:`~lightning_moe.checkpoint.resume.newest_complete_checkpoint`)
puts back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from pathlib import Path

__all__ = ["fsync_tree", "publish", "recover", "remove", "retired_path", "staging_path"]


def staging_path(path: str | Path) -> Path:
    """The hidden sibling a checkpoint for ``path`` is written into before :func:`publish`."""
    p = Path(path)
    return p.with_name(f".{p.name}.partial")


def retired_path(path: str | Path) -> Path:
    """Where a replaced checkpoint waits until its successor is published."""
    p = Path(path)
    return p.with_name(f".{p.name}.previous")


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (or ``path`` itself) and the folders that hold them."""
    if path.is_file():
        _fsync(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root), directory=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def recover(path: str | Path) -> None:
    """Put a retired checkpoint back if a crash came between its retirement and the publish."""
    p, old = Path(path), retired_path(path)
    if not p.exists() and old.exists():
        try:
            os.replace(old, p)
        except FileNotFoundError:  # another process of the job put it back first
            pass


def publish(staged: str | Path, path: str | Path) -> None:
    """Move the complete checkpoint ``staged`` to ``path``, replacing any checkpoint there."""
    staged, p = Path(staged), Path(path)
    if not staged.exists():
        raise FileNotFoundError(f"publish: staged={str(staged)!r} does not exist; write the checkpoint there first.")
    fsync_tree(staged)
    old = retired_path(p)
    if old.exists():
        recover(p)
        _rm(old)
    if (p.is_dir() or (p.exists() and staged.is_dir())) and _exchange(staged, p):
        _rm(staged)  # the old checkpoint, swapped out in the same step the new one came in
    elif p.is_dir() or (p.exists() and staged.is_dir()):
        os.replace(p, old)  # the old checkpoint stays, under its retired name, until the new one is in
        os.replace(staged, p)
        _rm(old)
    else:
        os.replace(staged, p)  # a file replaces a file atomically
    _fsync(p.parent, directory=True)


def remove(path: str | Path) -> None:
    """Delete a checkpoint; a folder is renamed away first so a half-deleted one is never read."""
    p = Path(path)
    if p.is_dir():
        doomed = p.with_name(f".{p.name}.removing")
        _rm(doomed)
        os.replace(p, doomed)
        _rm(doomed)
    elif p.exists():
        p.unlink()


def _rm(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
