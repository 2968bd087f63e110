"""Byte-level language-modelling data: the embedded default corpus and a DataModule.

The default corpus needs no download: it is the Python standard library's own ``.py`` source,
read from the running interpreter (``sysconfig.get_paths()["stdlib"]``). Tokens are raw bytes,
so the vocabulary is fixed at ``VOCAB_SIZE = 256`` and no tokenizer is involved.

Pipeline (all deterministic for a given interpreter and path):

1. read   the stdlib, a text file, a folder of ``*.txt``/``*.md``/``*.py`` files (sorted by
          relative path, joined by ``SEPARATOR``) or a pre-tokenized 1-D integer ``.npy``;
          cap the stream at ``max_bytes`` tokens.
2. split  contiguous: the first ``1 - val_fraction`` of the stream trains, the last
          ``val_fraction`` validates. No token is in both.
3. window ``TokenDataset`` cuts each split into windows of ``seq_len + 1`` tokens, ``stride``
          apart, and yields ``{"input_ids": w[:-1], "labels": w[1:]}`` as int64 ``[seq_len]``.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

__all__ = ["SEPARATOR", "TEXT_SUFFIXES", "VOCAB_SIZE", "MoEDataModule", "TokenDataset"]
__all__ += ["load_tokens", "stdlib_corpus", "stdlib_files"]

VOCAB_SIZE = 256
# NUL never occurs in Python or ordinary text, so it marks file boundaries unambiguously.
SEPARATOR = b"\x00"
TEXT_SUFFIXES = (".txt", ".md", ".py")
# Tests, IDLE and lib2to3 are large and repetitive (fixtures, grammar tables); site-packages
# depends on what happens to be installed, which would break determinism across machines.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def _missing_path(path: str) -> ValueError:
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
            raise _missing_path(path)
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


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Next-token windows over a 1-D token stream.

    Item ``i`` is the window ``w = tokens[i*stride : i*stride + seq_len + 1]`` as
    ``{"input_ids": w[:-1], "labels": w[1:]}``, both int64 ``[seq_len]``, so
    ``labels[j] == input_ids[j + 1]``. The default ``stride=seq_len`` makes inputs
    non-overlapping and uses every token as a target exactly once (neighbouring windows share
    one boundary token). A trailing remainder shorter than a window is dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int | None = None) -> None:
        stride = seq_len if stride is None else stride
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            got = f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
            raise ValueError(f"TokenDataset: tokens has {got}; pass a 1-D integer tensor.")
        for name, value in (("seq_len", seq_len), ("stride", stride)):
            if value < 1:
                raise ValueError(f"TokenDataset: {name}={value} must be >= 1; use a positive int.")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"TokenDataset: {tokens.numel()} tokens but seq_len={seq_len} needs at least {seq_len + 1}; "
                "lower seq_len or supply more tokens."
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"TokenDataset: index {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        window = self.tokens[start : start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


class MoEDataModule(LightningDataModule):
    """Byte-level LM data from the stdlib corpus, text files, a folder or a ``.npy``.

    Batches are ``{"input_ids": int64 [B, seq_len], "labels": int64 [B, seq_len]}``.

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
        seed: seeds the training shuffle (a DistributedSampler the Trainer inserts has its own).
        vocab_size: 256 for bytes; raise it for a ``.npy`` made by a larger tokenizer.
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
    ) -> None:
        super().__init__()
        if path is not None and not Path(path).exists():
            raise _missing_path(path)
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("vocab_size", vocab_size)):
            if value < 1:
                raise ValueError(f"MoEDataModule: {name}={value} must be >= 1; use a positive int.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"MoEDataModule: val_fraction={val_fraction} must be in (0, 1); use e.g. 0.05.")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"MoEDataModule: max_bytes={max_bytes} must be >= 1; use None to read everything.")
        if num_workers < 0:
            raise ValueError(f"MoEDataModule: num_workers={num_workers} must be >= 0; use 0 to load in-process.")
        self.save_hyperparameters()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.seed = seed
        self._vocab_size = vocab_size
        self.train_dataset: TokenDataset | None = None
        self.val_dataset: TokenDataset | None = None

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
        self.train_dataset = TokenDataset(tokens[:n_train], self.seq_len)
        self.val_dataset = TokenDataset(tokens[n_train:], self.seq_len)
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"MoEDataModule: the train split has {len(self.train_dataset)} windows of seq_len={self.seq_len}, "
                f"fewer than batch_size={self.batch_size} (partial batches are dropped); lower batch_size or add text."
            )

    def _loader(self, dataset: TokenDataset | None, train: bool) -> DataLoader[dict[str, torch.Tensor]]:
        if dataset is None:
            raise RuntimeError("MoEDataModule: a dataloader was requested before setup(); call dm.setup('fit') first.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            # A seeded generator makes the single-process order reproducible; when the Trainer
            # swaps in a DistributedSampler, that sampler's seed takes over.
            generator=torch.Generator().manual_seed(self.seed) if train else None,
            # Static batch shapes in training (CUDA graphs, compile); validation sees every window.
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return self._loader(self.val_dataset, train=False)
