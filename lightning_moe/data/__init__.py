"""Byte-level language-modelling data: the embedded default corpus, windows, a resumable order.

Pipeline (all deterministic for a given interpreter, path and seed):

1. read    (``corpus.py``) the stdlib, a text file, a folder of ``*.txt``/``*.md``/``*.py`` files
           (sorted by relative path, joined by ``SEPARATOR``) or a pre-tokenized 1-D integer
           ``.npy``; cap the stream at ``max_bytes`` tokens.
2. split   (``datamodule.py``) contiguous: the first ``1 - val_fraction`` of the stream trains,
           the last ``val_fraction`` validates. No token is in both.
3. window  (``datasets.py``) ``TokenDataset`` cuts each split into windows of ``seq_len + 1``
           tokens, ``stride`` apart, as ``{"input_ids": w[:-1], "labels": w[1:]}`` int64 ``[seq_len]``.
   or pack (``packing.py``, ``packing="pack"``) cuts each split into documents at its EOS tokens and
           packs them into rows with ``position_ids`` and ``document_ids`` (no label across documents).
4. order   (``sampler.py``) epoch ``e`` is a permutation seeded ``seed + e``, dealt out over the
           data-parallel ranks; the train loader's position is saved in checkpoints and restored.

Tokenized text (``text_datamodule.py``: ``TextDataModule``) follows the same order and packing
from local text, jsonl or parquet files and the checkpoint's own tokenizer (``tokenizer.py``),
with chat fine-tuning that puts the loss on assistant tokens only (``sft.py``). With ``cache_dir``
it tokenizes once into token shards on disk and reads each row from them, in memory that does not
grow with the corpus (``shard_*.py``, ``row_layout.py``, ``sharded_splits.py``; ``docs/data.md``).
"""

from lightning_moe.data.corpus import SEPARATOR, TEXT_SUFFIXES, VOCAB_SIZE, load_tokens, stdlib_corpus, stdlib_files
from lightning_moe.data.datamodule import MoEDataModule
from lightning_moe.data.datasets import TokenDataset
from lightning_moe.data.packing import (
    PACKED_KEYS,
    PackedDataset,
    check_packed_batch,
    document_ids_from_lengths,
    pack_documents,
    position_ids_from_document_ids,
)
from lightning_moe.data.sampler import ResumableDataLoader, ResumableSampler
from lightning_moe.data.text_datamodule import TextDataModule

__all__ = ["SEPARATOR", "TEXT_SUFFIXES", "VOCAB_SIZE", "MoEDataModule", "ResumableDataLoader", "ResumableSampler"]
__all__ += ["TokenDataset", "load_tokens", "stdlib_corpus", "stdlib_files"]
__all__ += ["PACKED_KEYS", "PackedDataset", "check_packed_batch", "document_ids_from_lengths", "pack_documents"]
__all__ += ["position_ids_from_document_ids"]
__all__ += ["TextDataModule"]
