"""Sizes and CRC-32 checksums of every file of a DCP checkpoint folder.

:func:`write_manifest` runs after the shards, ``.metadata`` and ``meta.pt`` are written and
before the folder is published; :func:`verify_checkpoint` reads every listed file back and raises
:class:`CheckpointError` naming the folder and the file at the first missing, truncated or changed
one, before anything is loaded. The manifest also carries what a loader needs to know about the
stored layout (``extra``: the experts' ``w13`` format, the degrees it was saved at).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "CheckpointError", "crc32_of", "read_manifest", "verify_checkpoint", "write_manifest"]

MANIFEST_NAME = "manifest.json"
_DCP_METADATA = ".metadata"
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: missing, truncated or damaged files."""


def crc32_of(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``folder/manifest.json`` listing every other file under ``folder``; returns its path."""
    root = Path(folder)
    files = {
        str(p.relative_to(root)): {"size": p.stat().st_size, "crc32": crc32_of(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    out = root / MANIFEST_NAME
    out.write_text(json.dumps({"format": 1, "files": files, **(extra or {})}, indent=1, sort_keys=True))
    return out


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The folder's manifest, or ``None`` for a folder written without one."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {MANIFEST_NAME} is unreadable ({err}); "
                              "the checkpoint is damaged: resume from another one.") from err  # fmt: skip


def verify_checkpoint(folder: str | Path, *, checksums: bool = True) -> dict[str, Any] | None:
    """Check a DCP folder against its manifest; returns the manifest (``None`` if it has none).

    Raises :class:`CheckpointError` for a missing ``.metadata`` and for any listed file that is
    missing, has another size or (``checksums``) another CRC-32. Without ``checksums`` no file
    is read: a quick test that the folder was published complete.
    """
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {str(root)!r} is not a folder; pass a DCP checkpoint folder.")
    manifest = read_manifest(root)
    if not (root / _DCP_METADATA).is_file():
        raise CheckpointError(
            f"checkpoint {str(root)!r}: file {_DCP_METADATA!r} is missing (the DCP index of every shard); "
            "the save did not finish or the folder was damaged: resume from another checkpoint."
        )
    if manifest is None:
        return None
    for name, want in manifest.get("files", {}).items():
        path = root / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(root)!r}: file {name!r} is missing; resume from another checkpoint.")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"checkpoint {str(root)!r}: file {name!r} has {size} bytes, the manifest says {want['size']} "
                "(truncated or overwritten); resume from another checkpoint."
            )
        crc = crc32_of(path) if checksums else want["crc32"]
        if crc != want["crc32"]:
            raise CheckpointError(
                f"checkpoint {str(root)!r}: file {name!r} fails its checksum (crc32 {crc:08x}, manifest "
                f"{want['crc32']:08x}): its bytes changed after the save; resume from another checkpoint."
            )
    return manifest
