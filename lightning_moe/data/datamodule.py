"""MoEDataModule: byte-level LM data with a resumable, data-parallel training order."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from lightning_moe.checks import check_float, check_int
from lightning_moe.data.corpus import SEPARATOR, VOCAB_SIZE, load_tokens, missing_path
from lightning_moe.data.datasets import TokenDataset
from lightning_moe.data.packing import (
    LONG_DOCUMENTS,
    PACKING_MODES,
    LongDocuments,
    PackedDataset,
    PackingMode,
    check_choice,
)
from lightning_moe.data.sampler import ResumableDataLoader, ResumableSampler

__all__ = ["MoEDataModule"]


class MoEDataModule(LightningDataModule):
    """Byte-level LM data from the stdlib corpus, text files, a folder or a ``.npy``.

    Batches are ``{"input_ids": int64 [B, seq_len], "labels": int64 [B, seq_len]}``: windows cut
    from the token stream with no regard to document boundaries. With ``packing="pack"`` they also
    hold ``"position_ids"`` and ``"document_ids"`` (int64 ``[B, seq_len]``): each split of the stream
    is cut into documents at its ``eos_id`` tokens (for the byte corpora: the files, which the reader
    joins with the NUL separator) and the documents are packed into rows
    (:mod:`lightning_moe.data.packing`: one EOS after each document, labels -100 across a
    document boundary and at padding, position ids restarting at each document).

    The train loader is a :class:`ResumableDataLoader`: its order depends only on ``seed``, the
    epoch and the data-parallel rank/size the strategy reports (``distributed_sampler_kwargs``; DP
    ranks, not the world, so tensor-parallel ranks of one replica read the same batches), and its
    position is saved in Lightning checkpoints, so a run resumed mid-epoch continues with the next
    unseen batch on every rank.

    Args:
        path: ``None`` for the embedded stdlib corpus; else a text file, a folder (all
            ``*.txt``/``*.md``/``*.py`` below it, sorted) or a 1-D integer ``.npy``.
        seq_len: tokens per training example.
        batch_size: examples per batch on each rank.
        val_fraction: the last fraction of the token stream, held out contiguously for
            validation; in ``(0, 1)``.
        max_bytes: cap on the token stream (one token per byte for text), keeping CPU runs
            quick; ``None`` reads everything.
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle: epoch ``e`` is the permutation drawn from ``seed + e``,
            dealt out over the strategy's data-parallel ranks.
        vocab_size: 256 for bytes; raise it for a ``.npy`` made by a larger tokenizer.
        packing: ``"none"`` (windows over the stream) or ``"pack"`` (packed documents).
        eos_id: the token that ends each document in the stream and follows each packed one;
            ``None`` is the NUL byte (0), the file separator of the byte corpora; a ``.npy`` made by
            a tokenizer needs its tokenizer's EOS id here.
        long_documents: what becomes of a document longer than a row: ``"split"`` over rows,
            ``"truncate"`` to one row, or ``"error"`` (naming its index and length); see
            :mod:`lightning_moe.data.packing`.
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: int | None = 4_000_000,
        num_workers: int = 0,
        seed: int = 0,
        vocab_size: int = VOCAB_SIZE,
        packing: PackingMode = "none",
        eos_id: int | None = None,
        long_documents: LongDocuments = "split",
    ) -> None:
        super().__init__()
        if path is not None and not isinstance(path, (str, Path)):
            raise TypeError(f"MoEDataModule: path={path!r} is not a str; pass a file or folder path, or None.")
        if path is not None and not Path(path).exists():
            raise missing_path(path)
        owner = "MoEDataModule"
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("vocab_size", vocab_size)):
            check_int(owner, name, value, fix="use a positive int")
        check_float(owner, "val_fraction", val_fraction, strict=True, fix="use a value in (0, 1), e.g. 0.05")
        if not val_fraction < 1.0:
            raise ValueError(f"MoEDataModule: val_fraction={val_fraction} must be in (0, 1); use e.g. 0.05.")
        check_int(owner, "max_bytes", max_bytes, optional=True, fix="use None to read everything")
        check_int(owner, "num_workers", num_workers, minimum=0, fix="use 0 to load in-process")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"MoEDataModule: seed={seed!r} is not an int; use e.g. seed=0.")
        check_choice(owner, "packing", packing, PACKING_MODES)
        check_choice(owner, "long_documents", long_documents, LONG_DOCUMENTS)
        check_int(owner, "eos_id", eos_id, minimum=0, optional=True, fix="use the tokenizer's EOS id")
        if packing == "pack" and eos_id is None and vocab_size > VOCAB_SIZE:
            raise ValueError(
                f"MoEDataModule: packing='pack' with vocab_size={vocab_size} needs eos_id (the default, the NUL "
                "byte 0, is the byte corpora's file separator); pass the EOS id of the tokenizer that made the data."
            )
        eos = SEPARATOR[0] if eos_id is None else eos_id
        if packing == "pack" and eos >= vocab_size:
            raise ValueError(
                f"MoEDataModule: eos_id={eos} is outside the vocabulary [0, vocab_size={vocab_size}); "
                "use the EOS id of the tokenizer that made the data."
            )
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.seed = seed
        self._vocab_size = vocab_size
        self.packing = packing
        self.eos_id = eos
        self.long_documents = long_documents
        self.train_dataset: TokenDataset | PackedDataset | None = None
        self.val_dataset: TokenDataset | PackedDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids; the model's embedding size must be at least this."""
        return self._vocab_size

    def setup(self, stage: str | None = None) -> None:
        # Read here, not in __init__, so building the module (e.g. by LightningCLI) stays instant.
        # Every rank reads the same local bytes: nothing to download, so no prepare_data.
        if self.train_dataset is not None:
            return
        tokens = load_tokens(self.path, self.max_bytes, self._vocab_size)
        n = tokens.numel()
        n_train = math.floor(n * (1.0 - self.val_fraction))
        need = self.seq_len + 1
        if min(n_train, n - n_train) < need:
            total = math.ceil(need / min(self.val_fraction, 1.0 - self.val_fraction))
            raise ValueError(
                f"MoEDataModule: the corpus has {n} tokens, split into {n_train} train and {n - n_train} val "
                f"(val_fraction={self.val_fraction}), but seq_len={self.seq_len} needs {need} tokens in each split "
                f"(about {total} in total); lower seq_len, raise max_bytes, or supply more text."
            )
        self.train_dataset = self._dataset(tokens[:n_train])
        self.val_dataset = self._dataset(tokens[n_train:])
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"MoEDataModule: the train split has {len(self.train_dataset)} {self._unit} of seq_len={self.seq_len}, "
                f"fewer than batch_size={self.batch_size} (partial batches are dropped); lower batch_size or add text."
            )

    @property
    def _unit(self) -> str:
        return "packed rows" if self.packing == "pack" else "windows"

    def _dataset(self, tokens: torch.Tensor) -> TokenDataset | PackedDataset:
        if self.packing == "pack":
            return PackedDataset(tokens, self.seq_len, self.eos_id, self.long_documents)
        return TokenDataset(tokens, self.seq_len)

    def _dp_rank_size(self) -> tuple[int, int]:
        """``(rank, size)`` of data parallelism from the attached Trainer's strategy; ``(0, 1)`` alone."""
        trainer = self.trainer  # None when the module is used without a Trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 0, 1
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def train_dataloader(self) -> ResumableDataLoader:
        dataset = self._require(self.train_dataset)
        rank, size = self._dp_rank_size()
        if len(dataset) < self.batch_size * size:
            raise ValueError(
                f"MoEDataModule: the train split has {len(dataset)} {self._unit}, fewer than "
                f"batch_size={self.batch_size} "
                f"x {size} data-parallel ranks; lower batch_size or add text."
            )
        sampler = ResumableSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=self.seed)
        return ResumableDataLoader(dataset, sampler, batch_size=self.batch_size, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        # In order and whole (the last partial batch too); under several ranks the Trainer inserts
        # its unshuffled DistributedSampler.
        return DataLoader(
            self._require(self.val_dataset),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @staticmethod
    def _require(dataset: TokenDataset | PackedDataset | None) -> TokenDataset | PackedDataset:
        if dataset is None:
            raise RuntimeError("MoEDataModule: a dataloader was requested before setup(); call dm.setup('fit') first.")
        return dataset
