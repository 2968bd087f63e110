"""Unit tests for the lightning_moe.data package: corpus, windows, split, inputs and errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_moe.data import (
    SEPARATOR,
    VOCAB_SIZE,
    MoEDataModule,
    TokenDataset,
    load_tokens,
    stdlib_corpus,
    stdlib_files,
)


def _fit_dm(**kwargs: object) -> MoEDataModule:
    dm = MoEDataModule(**kwargs)  # type: ignore[arg-type]
    dm.setup("fit")
    return dm


def test_stdlib_corpus_is_deterministic_nonempty_bytes() -> None:
    a, b = stdlib_corpus(max_bytes=50_000), stdlib_corpus(max_bytes=50_000)
    assert isinstance(a, bytes) and len(a) == 50_000
    assert a == b
    assert VOCAB_SIZE == 256


def test_stdlib_files_are_sorted_and_skip_tests_and_site_packages() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root) for p in stdlib_files()]
    assert rel, "the running interpreter should ship stdlib source"
    assert all(p.suffix == ".py" for p in rel)
    dirs = {part for p in rel for part in p.parts[:-1]}
    assert not dirs & {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    assert not any(p.name.startswith("_sysconfigdata") for p in rel)
    posix = [p.as_posix() for p in rel]
    assert posix == sorted(posix)


def test_token_dataset_windows_shift_by_one() -> None:
    tokens = torch.arange(0, 21, dtype=torch.uint8)
    ds = TokenDataset(tokens, seq_len=4)
    # (21 - 5) // 4 + 1 windows starting at 0, 4, 8, 12, 16.
    assert len(ds) == 5
    item = ds[1]
    assert item["input_ids"].dtype == torch.int64 and item["labels"].dtype == torch.int64
    assert item["input_ids"].tolist() == [4, 5, 6, 7]
    assert item["labels"].tolist() == [5, 6, 7, 8]
    assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
    assert ds[-1]["labels"].tolist() == [17, 18, 19, 20]
    with pytest.raises(IndexError, match="5"):
        ds[5]


def test_token_dataset_stride_overlaps_windows() -> None:
    ds = TokenDataset(torch.arange(10), seq_len=4, stride=1)
    assert len(ds) == 6
    assert ds[2]["input_ids"].tolist() == [2, 3, 4, 5]


def test_split_is_contiguous_and_disjoint() -> None:
    dm = _fit_dm(seq_len=16, batch_size=2, val_fraction=0.1, max_bytes=20_000)
    corpus = torch.frombuffer(bytearray(stdlib_corpus(20_000)), dtype=torch.uint8)
    train, val = dm.train_dataset, dm.val_dataset
    assert train is not None and val is not None
    n_train = train.tokens.numel()
    assert n_train + val.tokens.numel() == corpus.numel()
    assert n_train == 18_000
    # Train is the head, val the tail, with no token in both.
    assert torch.equal(train.tokens, corpus[:n_train])
    assert torch.equal(val.tokens, corpus[n_train:])


def test_dataloaders_yield_batches_and_seeded_shuffle() -> None:
    dm = _fit_dm(seq_len=8, batch_size=4, max_bytes=4_000, seed=3)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    again = next(iter(_fit_dm(seq_len=8, batch_size=4, max_bytes=4_000, seed=3).train_dataloader()))
    assert torch.equal(batch["input_ids"], again["input_ids"])
    val_batches = list(dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val_batches) == len(dm.val_dataset)  # type: ignore[arg-type]
    assert dm.vocab_size == 256


def test_text_file_input(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world " * 50)
    dm = _fit_dm(path=str(f), seq_len=8, batch_size=2, val_fraction=0.2)
    assert dm.train_dataset is not None
    assert bytes(dm.train_dataset.tokens.tolist()).startswith(b"hello world")


def test_folder_input_reads_text_files_sorted(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_bytes(b"B" * 40)
    (tmp_path / "sub" / "c.py").write_bytes(b"C" * 40)
    (tmp_path / "a.txt").write_bytes(b"A" * 40)
    (tmp_path / "skip.bin").write_bytes(b"X" * 40)
    tokens = load_tokens(str(tmp_path), max_bytes=None)
    expected = b"A" * 40 + SEPARATOR + b"B" * 40 + SEPARATOR + b"C" * 40 + SEPARATOR
    assert bytes(tokens.tolist()) == expected
    assert bytes(load_tokens(str(tmp_path), max_bytes=50).tolist()) == expected[:50]
    _fit_dm(path=str(tmp_path), seq_len=4, batch_size=2, val_fraction=0.2)


def test_npy_input(tmp_path: Path) -> None:
    f = tmp_path / "tok.npy"
    np.save(f, np.arange(300, dtype=np.int32) % 256)
    dm = _fit_dm(path=str(f), seq_len=8, batch_size=2, val_fraction=0.1, max_bytes=200)
    assert dm.train_dataset is not None and dm.val_dataset is not None
    assert dm.train_dataset.tokens.numel() + dm.val_dataset.tokens.numel() == 200
    assert dm.train_dataset[0]["input_ids"].tolist() == list(range(8))


def test_npy_input_with_larger_vocab(tmp_path: Path) -> None:
    f = tmp_path / "tok.npy"
    np.save(f, np.arange(1000, dtype=np.int64))
    dm = _fit_dm(path=str(f), seq_len=8, batch_size=2, vocab_size=1000)
    assert dm.vocab_size == 1000
    assert dm.train_dataset is not None and dm.train_dataset[1]["labels"][-1].item() == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, "seq_len=0"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"val_fraction": 0.0}, "val_fraction=0.0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"max_bytes": 0}, "max_bytes=0"),
        ({"num_workers": -1}, "num_workers=-1"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"path": "/no/such/file.txt"}, "path='/no/such/file.txt' does not exist"),
    ],
)
def test_bad_init_args_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEDataModule(**kwargs)  # type: ignore[arg-type]


def test_empty_file_raises(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.txt' holds no tokens"):
        MoEDataModule(path=str(f)).setup("fit")


def test_folder_without_text_files_raises(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="folder with no"):
        MoEDataModule(path=str(tmp_path)).setup("fit")


def test_folder_of_empty_text_files_raises(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no tokens"):
        MoEDataModule(path=str(tmp_path)).setup("fit")


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.array([1, 2, 256, 3]), r"\[1, 256\].*vocab_size=256.*vocab_size >= 257"),
        (np.array([1, -1, 3]), r"\[-1, 3\]"),
        (np.ones(10, dtype=np.float32), r"shape \(10,\) and dtype float32"),
        (np.ones((4, 4), dtype=np.int64), r"shape \(4, 4\)"),
        (np.zeros(0, dtype=np.int64), "holds no tokens"),
    ],
)
def test_bad_npy_raises(tmp_path: Path, array: np.ndarray, match: str) -> None:
    f = tmp_path / "bad.npy"
    np.save(f, array)
    with pytest.raises(ValueError, match=match):
        MoEDataModule(path=str(f)).setup("fit")


def test_text_with_small_vocab_raises(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes(b"\xff" * 100)
    with pytest.raises(ValueError, match=r"ids in \[255, 255\], outside \[0, vocab_size=100\).*vocab_size >= 256"):
        MoEDataModule(path=str(f), vocab_size=100).setup("fit")


def test_corpus_too_short_for_split_raises(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"100 tokens.*seq_len=128 needs 129"):
        MoEDataModule(path=str(f), seq_len=128).setup("fit")


def test_train_split_smaller_than_batch_raises(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        MoEDataModule(path=str(f), seq_len=4, batch_size=64, val_fraction=0.2).setup("fit")


def test_token_dataset_errors() -> None:
    with pytest.raises(ValueError, match="seq_len=0"):
        TokenDataset(torch.arange(10), seq_len=0)
    with pytest.raises(ValueError, match="stride=0"):
        TokenDataset(torch.arange(10), seq_len=2, stride=0)
    with pytest.raises(ValueError, match="10 tokens but seq_len=10 needs at least 11"):
        TokenDataset(torch.arange(10), seq_len=10)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        TokenDataset(torch.ones(10), seq_len=2)


def test_dataloader_before_setup_raises() -> None:
    with pytest.raises(RuntimeError, match=r"setup\(\)"):
        MoEDataModule().train_dataloader()


def test_val_dataloader_keeps_window_order_and_last_partial_batch() -> None:
    dm = _fit_dm(seq_len=8, batch_size=4, max_bytes=4_000, val_fraction=0.1, seed=3)
    val = dm.val_dataset
    assert val is not None and len(val) % 4 != 0  # 400 val tokens: 49 windows, the last batch partial
    batches = list(dm.val_dataloader())
    seen = torch.cat([b["input_ids"] for b in batches])
    expected = torch.stack([val[i]["input_ids"] for i in range(len(val))])
    assert torch.equal(seen, expected)
