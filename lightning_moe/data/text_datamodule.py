"""TextDataModule: tokenized text (pretraining) or chats (SFT) from local files, packed, resumable.

Legend: R rows, S sequence length (``seq_len``).

Pipeline (deterministic for given files, tokenizer and seed):

1. read     (``text.py``) the train files (text, jsonl field, parquet column), streamed record by record.
2. split    with no ``val_files``, each record goes to validation with probability ``val_fraction``,
            drawn from ``random.Random(seed)`` in reading order (a fixed split for a fixed seed; no
            record in both). With ``val_files`` those are the validation set and nothing is held out.
3. tokenize ``task="lm"``: the tokenizer's ids of each text (``tokenizer.py``); every next token is a
            label. ``task="sft"``: each record is a chat; the chat template renders it and only the
            assistant's tokens are labels (``sft.py``).
4. rows     ``packing="pack"``: :func:`~lightning_moe.data.packing.pack_documents` lays the documents
            end to end with the tokenizer's EOS after each (next fit), with ``position_ids`` and
            ``document_ids``; no label crosses a document. ``packing="none"``: one document per row,
            padded with EOS (labels -100). In SFT the EOS packing adds after a chat carries no loss
            (the template's own end-of-turn tokens do). A document longer than a row is, by
            ``long_documents``: ``"split"`` over rows, ``"truncate"`` to one row (with a warning
            giving the count and the first one's file and line), or ``"error"``.
5. order    the train loader is the :class:`~lightning_moe.data.sampler.ResumableDataLoader` of
            :class:`~lightning_moe.data.MoEDataModule` (seeded, data-parallel, its position saved in
            checkpoints); validation is in order.

Batches: ``{"input_ids", "labels"}`` int64 ``[B, S]``, plus ``"position_ids"``, ``"document_ids"`` when
packed.

Memory. With ``cache_dir`` set, steps 1-4 run once into files under it and the rows are read from
there (``sharded_splits.py``): the records are tokenized one at a time into on-disk token
shards (uint16/uint32 ids, a document index, SFT masks; reused while the source files and the
tokenizer are unchanged, ``docs/data.md``), the split and the row layout are computed in one pass
over the document lengths and stored too, and each row is read from those files when the loader
asks for it, so memory does not grow with the corpus. The rows, the split and the order are
exactly those of the in-memory path. Without ``cache_dir`` the records stream from disk and each is
kept only as its int32 token ids (and a uint8 mask in SFT), so the corpus costs about 4 bytes per
token in memory (5 in SFT), then as much again in int32 rows. Packing runs on runs of documents of
about ``PACK_CHUNK_TOKENS`` tokens at a time, which bounds its working memory; the last row of each
run may be part-filled (at most one row per run).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import LightningDataModule
from torch.utils.data import Dataset

from lightning_moe.checks import check_float, check_int
from lightning_moe.data.datamodule import MoEDataModule
from lightning_moe.data.packing import (
    IGNORE_INDEX,
    LONG_DOCUMENTS,
    PACKING_MODES,
    LongDocuments,
    PackingMode,
    check_choice,
    pack_documents,
)
from lightning_moe.data.row_layout import LayoutSpec
from lightning_moe.data.sft import tokenize_chat
from lightning_moe.data.shard_cache import ShardSource, where_of_document
from lightning_moe.data.shard_rows import ShardRowsDataset
from lightning_moe.data.sharded_splits import sharded_splits
from lightning_moe.data.text import FORMATS, TEXT_UNITS, TextFormat, TextUnit, expand_paths, read_records
from lightning_moe.data.tokenizer import encode_text, eos_token_id, load_tokenizer

__all__ = ["PACK_CHUNK_TOKENS", "TASKS", "RowsDataset", "Task", "TextDataModule", "build_rows"]

Task = Literal["lm", "sft"]
TASKS = ("lm", "sft")
_DEFAULT_FIELD = {"lm": "text", "sft": "messages"}
PACK_CHUNK_TOKENS = 1 << 20


class _Doc(NamedTuple):
    ids_T: torch.Tensor  # int32
    mask_T: torch.Tensor | None  # uint8, SFT only
    where: str


class RowsDataset(Dataset[dict[str, torch.Tensor]]):
    """Rows stored as int32 ``[R, S]`` tensors under the batch keys; item ``i`` is row ``i`` in int64."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = {k: v.to(torch.int32) for k, v in rows.items()}
        self._len = next(iter(self.rows.values())).shape[0] if self.rows else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"RowsDataset: index {index} out of range for {len(self)} rows")
        return {k: v[index].long() for k, v in self.rows.items()}


def build_rows(
    documents: Sequence[Sequence[int] | torch.Tensor],
    masks: Sequence[Sequence[int] | torch.Tensor] | None,
    seq_len: int,
    eos_id: int,
    packing: PackingMode = "pack",
    long_documents: LongDocuments = "split",
) -> dict[str, torch.Tensor]:
    """Rows ``[R, seq_len]`` of ``documents`` (module doc, step 4).

    ``masks`` (one 0/1 list per document, SFT) keeps a label only where the predicted token has mask
    1; ``None`` labels every next token. ``packing="none"`` returns ``input_ids`` and ``labels`` only.
    """
    if masks is not None and [len(m) for m in masks] != [len(d) for d in documents]:
        raise ValueError("build_rows: masks must hold one entry per token of each document.")
    if packing == "none":
        return _one_per_row(documents, masks, seq_len, eos_id, long_documents)
    rows = pack_documents(documents, seq_len, eos_id, long_documents)
    if masks is not None:  # same lengths, so the same layout; the EOS after a document has mask 0
        keep = pack_documents(masks, seq_len, 0, long_documents)["labels"] == 1
        rows["labels"] = torch.where(keep, rows["labels"], IGNORE_INDEX)
    return rows


def _one_per_row(
    documents: Sequence[Sequence[int] | torch.Tensor],
    masks: Sequence[Sequence[int] | torch.Tensor] | None,
    seq_len: int,
    eos_id: int,
    long_documents: str,
) -> dict[str, torch.Tensor]:
    """``pack_documents`` of each document alone (its EOS, padding with EOS, ``long_documents``), all at once.

    Pieces of a split document overlap by one token, as in ``pack_documents``: piece ``k`` of a row's
    ``seq_len + 1`` tokens starts at token ``k * seq_len`` of the document and its EOS.
    """
    row_len = seq_len + 1
    lengths = [len(d) + 1 for d in documents]  # with the EOS
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    src, take = [], []
    for index, (start, n) in enumerate(zip(starts, lengths)):
        if n < 2:  # an empty document: no label, no row
            continue
        if n > row_len and long_documents == "error":
            raise ValueError(
                f"build_rows: document {index} has {n - 1} tokens ({n} with its EOS), more than a row of "
                f"seq_len + 1 = {row_len} tokens holds; set long_documents='split' or 'truncate', or raise seq_len."
            )
        if n <= row_len or long_documents == "truncate":
            src.append(start)
            take.append(min(n, row_len))
            continue
        for first in range(0, n - 1, seq_len):  # split
            src.append(start + first)
            take.append(min(row_len, n - first))
    if not src:
        return {k: torch.empty(0, seq_len, dtype=torch.int64) for k in ("input_ids", "labels")}
    eos = torch.tensor([eos_id], dtype=torch.int64)
    stream_T = torch.cat([t for d in documents for t in (torch.as_tensor(d, dtype=torch.int64), eos)])
    src_R, take_R = torch.tensor(src), torch.tensor(take)
    col_C = torch.arange(row_len)
    inside_RC = col_C < take_R[:, None]
    index_RC = torch.where(inside_RC, src_R[:, None] + col_C, 0)
    tokens_RC = torch.where(inside_RC, stream_T[index_RC], eos_id)
    labelled_RS = inside_RC[:, 1:]
    if masks is not None:  # the EOS after a document has mask 0
        zero = torch.zeros(1, dtype=torch.int64)
        mask_T = torch.cat([t for m in masks for t in (torch.as_tensor(m, dtype=torch.int64), zero)])
        labelled_RS = labelled_RS & (mask_T[index_RC[:, 1:]] == 1)
    return {"input_ids": tokens_RC[:, :-1], "labels": torch.where(labelled_RS, tokens_RC[:, 1:], IGNORE_INDEX)}


class TextDataModule(MoEDataModule):
    """Tokenized text or chats from local files (module doc), as a :class:`MoEDataModule`.

    Being an ``MoEDataModule`` (same loaders, same resumable order), ``lightning-moe fit`` accepts it
    as ``data: {class_path: lightning_moe.data.text_datamodule.TextDataModule, init_args: ...}``.

    Args:
        tokenizer_dir: a folder a tokenizer was saved to (``save_pretrained``); local files only.
        train_files: a file, a folder or a list of them (``text.py``).
        val_files: validation files; ``None`` holds out ``val_fraction`` of the train records.
        format: ``"auto"`` (by suffix; a saved ``datasets`` folder by its files), ``"text"``, ``"jsonl"``,
            ``"parquet"`` or ``"datasets"`` (a folder ``Dataset.save_to_disk`` wrote).
        field: the jsonl key / parquet or dataset column; ``None``: ``"text"`` (lm) or ``"messages"`` (sft).
        text_unit: what one document of a text file is: ``"file"``, ``"line"`` or ``"paragraph"``.
        task: ``"lm"`` (every token a label) or ``"sft"`` (chats; loss on assistant tokens only).
        seq_len: tokens per row.
        batch_size: rows per batch on each rank.
        val_fraction: share of train records held out when ``val_files`` is ``None``; in ``(0, 1)``.
        seed: seeds the held-out draw and the training order.
        packing: ``"pack"`` (documents end to end) or ``"none"`` (one document per row, padded).
        long_documents: a document longer than a row: ``"split"``, ``"truncate"`` (warns) or ``"error"``.
        max_documents: read at most this many train records (and as many validation ones); ``None``: all.
        num_workers: DataLoader worker processes.
        cache_dir: a folder for token shards and row layouts (module doc, "Memory"); ``None`` keeps
            everything in memory. Safe to delete between runs (it is rebuilt); shared by several
            data modules and runs (each set is named after what it was made from).
    """

    def __init__(
        self,
        tokenizer_dir: str,
        train_files: str | list[str],
        val_files: str | list[str] | None = None,
        format: TextFormat = "auto",
        field: str | None = None,
        text_unit: TextUnit = "file",
        task: Task = "lm",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        packing: PackingMode = "pack",
        long_documents: LongDocuments = "split",
        max_documents: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        LightningDataModule.__init__(self)  # MoEDataModule's own arguments describe byte corpora
        owner = "TextDataModule"
        check_choice(owner, "task", task, TASKS)
        check_choice(owner, "format", format, FORMATS)
        check_choice(owner, "text_unit", text_unit, TEXT_UNITS)
        check_choice(owner, "packing", packing, PACKING_MODES)
        check_choice(owner, "long_documents", long_documents, LONG_DOCUMENTS)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            check_int(owner, name, value, fix="use a positive int")
        check_int(owner, "max_documents", max_documents, optional=True, fix="use None to read everything")
        check_int(owner, "num_workers", num_workers, minimum=0, fix="use 0 to load in-process")
        check_float(owner, "val_fraction", val_fraction, strict=True, fix="use a value in (0, 1), e.g. 0.05")
        if not val_fraction < 1.0:
            raise ValueError(f"{owner}: val_fraction={val_fraction} must be in (0, 1); use e.g. 0.05.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{owner}: seed={seed!r} is not an int; use e.g. seed=0.")
        if field is not None and (not isinstance(field, str) or not field):
            raise ValueError(f"{owner}: field={field!r} must be a non-empty str or None (the default per task).")
        if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir):
            raise ValueError(f"{owner}: cache_dir={cache_dir!r} must be a non-empty folder path or None (in memory).")
        # Paths are listed now (a missing file fails at construction); files are read in setup.
        expand_paths(train_files, format, owner)
        if val_files is not None:
            expand_paths(val_files, format, owner)
        self.save_hyperparameters()
        self.tokenizer_dir = tokenizer_dir
        self.train_files, self.val_files = train_files, val_files
        self.format, self.text_unit, self.task = format, text_unit, task
        self.field = _DEFAULT_FIELD[task] if field is None else field
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_fraction, self.seed = val_fraction, seed
        self.packing, self.long_documents = packing, long_documents
        self.max_documents, self.num_workers = max_documents, num_workers
        self.cache_dir = cache_dir
        self._tokenizer: Any = None
        self.train_dataset: RowsDataset | ShardRowsDataset | None = None  # type: ignore[assignment]
        self.val_dataset: RowsDataset | ShardRowsDataset | None = None  # type: ignore[assignment]

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of ``tokenizer_dir`` (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_dir, owner="TextDataModule")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)`` (added tokens included): the model's embedding must be at least this."""
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int:  # type: ignore[override]
        return eos_token_id(self.tokenizer, owner="TextDataModule")

    @property
    def _unit(self) -> str:
        return "packed rows" if self.packing == "pack" else "rows"

    def prepare_data(self) -> None:
        # Once per node (Lightning's local rank 0) before setup: the shards and the layout are written
        # here, so every rank's setup finds them complete.
        if self.cache_dir is not None:
            self._sharded()

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        if self.cache_dir is not None:
            self.train_dataset, self.val_dataset = self._sharded()
        else:
            eos = self.eos_id
            train, val = self._read_splits()
            self.train_dataset = RowsDataset(self._rows(train, eos))
            self.val_dataset = RowsDataset(self._rows(val, eos))
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"TextDataModule: the train split has {len(self.train_dataset)} {self._unit} of "
                f"seq_len={self.seq_len}, "
                f"fewer than batch_size={self.batch_size} (partial batches are dropped); lower batch_size or add data."
            )

    def _source(self, files: str | list[str]) -> ShardSource:
        listed = expand_paths(files, self.format, "TextDataModule")
        return ShardSource(tuple(str(f) for f in listed), self.format, self.field, self.text_unit, self.task,
                           self.max_documents)  # fmt: skip

    def _sharded(self) -> tuple[ShardRowsDataset, ShardRowsDataset]:
        spec = LayoutSpec(self.seq_len, self.packing, self.long_documents, PACK_CHUNK_TOKENS)
        val = None if self.val_files is None else self._source(self.val_files)
        splits = sharded_splits(str(self.cache_dir), self._source(self.train_files), val, self.tokenizer,
                                self.tokenizer_dir, spec, (self.seed, self.val_fraction), self.eos_id)  # fmt: skip
        counts = {name: s["documents"] for name, s in splits.summary.items()}
        self._check_split_counts(counts["train"], counts["validation"])
        for name, s in splits.summary.items():
            if s["long"]:
                source = splits.sources[name]
                self._check_long(s["long"], lambda: where_of_document(source, s["first_long"]))
        return splits.train, splits.validation

    def _tokenized(self, files: str | list[str]) -> Iterable[_Doc]:
        records = read_records(files, self.format, self.field, self.text_unit)
        for n, (value, where) in enumerate(records):
            if self.max_documents is not None and n >= self.max_documents:
                return
            if self.task == "sft":
                ids, mask = tokenize_chat(self.tokenizer, value, where)
                yield _Doc(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8), where)
            else:
                yield _Doc(torch.tensor(encode_text(self.tokenizer, value, where), dtype=torch.int32), None, where)

    def _read_splits(self) -> tuple[list[_Doc], list[_Doc]]:
        train: list[_Doc] = []
        val: list[_Doc] = []
        if self.val_files is not None:
            train = list(self._tokenized(self.train_files))
            val = list(self._tokenized(self.val_files))
        else:
            draw = random.Random(self.seed)
            for doc in self._tokenized(self.train_files):
                (val if draw.random() < self.val_fraction else train).append(doc)
        self._check_split_counts(len(train), len(val))
        return train, val

    def _check_split_counts(self, train: int, val: int) -> None:
        for name, docs in (("train", train), ("validation", val)):
            if not docs:
                fix = "raise val_fraction or add records" if name == "validation" else "add records"
                if self.val_files is not None and name == "validation":
                    fix = "check val_files"
                raise ValueError(
                    f"TextDataModule: the {name} split holds no document ({train} train, {val} "
                    f"validation; val_fraction={self.val_fraction}, seed={self.seed}); {fix}."
                )

    def _check_long(self, count: int, first_where: Callable[[], str]) -> None:
        """Warn (``"truncate"``) or refuse (``"error"``) ``count`` documents longer than a row."""
        if count and self.long_documents == "truncate":
            rank_zero_warn(
                f"TextDataModule: {count} document(s) longer than seq_len={self.seq_len} tokens are truncated "
                f"to one row (the first: {first_where()}); set long_documents='split' to keep all their tokens."
            )
        if count and self.long_documents == "error":
            raise ValueError(
                f"TextDataModule: {first_where()} has more tokens than seq_len={self.seq_len} ({count} such "
                "document(s)); set long_documents='split' or 'truncate', or raise seq_len."
            )

    def _rows(self, docs: list[_Doc], eos: int) -> dict[str, torch.Tensor]:
        long = [d.where for d in docs if d.ids_T.numel() > self.seq_len]
        self._check_long(len(long), lambda: long[0])
        parts: list[dict[str, torch.Tensor]] = []
        start, tokens = 0, 0
        for end, doc in enumerate(docs, 1):
            tokens += doc.ids_T.numel()
            if tokens >= PACK_CHUNK_TOKENS or end == len(docs):
                chunk = docs[start:end]
                masks = [d.mask_T for d in chunk] if self.task == "sft" else None
                rows = build_rows([d.ids_T for d in chunk], masks, self.seq_len, eos, self.packing,
                                  self.long_documents)  # fmt: skip
                parts.append({k: v.to(torch.int32) for k, v in rows.items()})
                start, tokens = end, 0
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
