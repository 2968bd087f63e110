"""The newest complete checkpoint of a folder: what an automatic resume starts from.

A restarted job (``torchrun --max-restarts``, a SLURM requeue) runs the same command again;
with ``ckpt_path="last"`` Lightning picks the newest ``last*.ckpt`` of the ``ModelCheckpoint``
folder, or starts fresh when there is none. Saves are atomic (:mod:`.atomic`), so that entry is
always complete. :func:`newest_complete_checkpoint` is the same choice for any folder of
checkpoints, skipping staged or retired ones and DCP folders that fail verification.
"""

from __future__ import annotations

from pathlib import Path

from lightning_moe.checkpoint.atomic import recover
from lightning_moe.checkpoint.manifest import CheckpointError, verify_checkpoint

__all__ = ["newest_complete_checkpoint"]


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
