"""The newest complete checkpoint of a folder: what an automatic resume starts from.

A restarted job (``torchrun --max-restarts``, a SLURM requeue) runs the same command again;
with ``ckpt_path="last"`` Lightning picks the newest ``last*.ckpt`` of the ``ModelCheckpoint``
folder, or starts fresh when there is none. Saves are atomic (:mod:`.atomic`), so that entry is
always complete, but a crash during the *first* write of ``last.ckpt`` leaves none while the
``step=N`` checkpoint written just before it is whole. :func:`newest_complete_checkpoint` is the
same choice for any folder of checkpoints, skipping staged or retired ones and DCP folders that
fail verification; :func:`last_or_newest_complete` keeps the ``last`` Lightning chose when it was
published complete and otherwise falls back to the newest complete checkpoint of the folders.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lightning_moe.checkpoint.atomic import recover
from lightning_moe.checkpoint.manifest import CheckpointError, verify_checkpoint

__all__ = ["is_published", "last_or_newest_complete", "newest_complete_checkpoint"]


def newest_complete_checkpoint(folder: str | Path, suffix: str = ".ckpt") -> Path | None:
    """The most recently written checkpoint under ``folder`` that verifies; ``None`` if none does."""
    root = Path(folder)
    if not root.is_dir():
        return None
    for hidden in root.glob(f".*{suffix}.previous"):
        recover(root / hidden.name[1 : -len(".previous")])
    candidates = [p for p in root.iterdir() if p.name.endswith(suffix) and not p.name.startswith(".")]
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        if path.is_file():
            return path
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def is_published(path: str | Path) -> bool:
    """``path`` is a checkpoint that was published complete: a file (written aside, renamed into
    place), or a folder with its DCP index and every file of its manifest at its size (no file
    is read)."""
    p = Path(path)
    if p.is_file():
        return True
    try:
        verify_checkpoint(p, checksums=False)
    except CheckpointError:
        return False
    return True


def last_or_newest_complete(last: str | Path | None, folders: Iterable[str | Path]) -> tuple[Path | None, str | None]:
    """``(checkpoint to resume from, why it is not last)``: ``last`` when it is published
    complete; otherwise the newest complete checkpoint of ``folders`` with a sentence naming it
    (``None`` when there is no other); ``(last, None)`` when no folder has one."""
    if last is not None and is_published(last):
        return Path(last), None
    found = [p for p in (newest_complete_checkpoint(f) for f in folders) if p is not None]
    if not found:
        return (Path(last) if last is not None else None), None
    best = max(found, key=lambda p: p.stat().st_mtime_ns)
    what = f"{str(last)!r} is not complete" if last is not None else "no last checkpoint was published"
    return best, f'ckpt_path="last": {what}; resuming from {str(best)!r}, the newest complete checkpoint of its folder.'
