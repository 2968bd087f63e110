"""Checkpoints that survive a crash, are verified on load and do not depend on the layout.

* :mod:`.atomic`: write aside, fsync, then publish by rename; the replaced checkpoint stays until
  the new one is complete;
* :mod:`.manifest`: sizes and CRC-32 of every file of a DCP folder, written after the data and
  checked before any weight changes;
* :mod:`.experts`: ``w13`` stored as separate ``gate`` and ``up`` tensors, so a DCP reshard is
  right for every ETP degree;
* :mod:`.hparams`: hyper-parameter config dataclasses stored as plain dicts (``weights_only``
  loads need no allow-list) and rebuilt on load;
* :mod:`.dcp`: the folded strategies' DCP save and load built from the above;
* :mod:`.read`: a checkpoint (a ``.ckpt`` file or a DCP folder) read whole on one process, for
  exports and generation;
* :mod:`.resume`: the newest complete checkpoint of a folder (auto-resume).
"""

from __future__ import annotations

from lightning_moe.checkpoint.atomic import publish, remove, staging_path
from lightning_moe.checkpoint.hparams import config_from_plain, config_to_plain
from lightning_moe.checkpoint.manifest import MANIFEST_NAME, CheckpointError, verify_checkpoint, write_manifest
from lightning_moe.checkpoint.resume import newest_complete_checkpoint

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "config_from_plain",
    "config_to_plain",
    "newest_complete_checkpoint",
    "publish",
    "remove",
    "staging_path",
    "verify_checkpoint",
    "write_manifest",
]
