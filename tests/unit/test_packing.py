"""Packed sequences: row layout against a token-by-token reference, labels, ids, checks, the data module."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lightning_moe.data import (
    PACKED_KEYS,
    MoEDataModule,
    PackedDataset,
    check_packed_batch,
    document_ids_from_lengths,
    pack_documents,
    position_ids_from_document_ids,
)

EOS = 0


def _reference_pack(docs: list[list[int]], seq_len: int, eos: int, mode: str) -> dict[str, list[list[int]]]:
    """Next-fit packing written token by token: rows of (token, piece) pairs, then the four keys."""
    row_len = seq_len + 1
    rows: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    piece = 0

    def close() -> None:
        nonlocal cur
        if cur:
            rows.append(cur + [(eos, -1)] * (row_len - len(cur)))
            cur = []

    for doc in docs:
        if not doc:
            continue
        unit = doc + [eos]
        if len(unit) > row_len:
            if mode == "truncate":
                close()
                cur = [(t, piece) for t in unit[:row_len]]
                piece += 1
                close()
                continue
            # split: fill the row, then continue from the row's last token in the next one
            i = 0
            while True:
                room = row_len - len(cur)
                chunk = unit[i : i + room]
                cur += [(t, piece) for t in chunk]
                piece += 1
                if i + len(chunk) == len(unit):
                    break
                i += len(chunk) - 1
                close()
        else:
            if len(cur) + len(unit) > row_len:
                close()
            cur += [(t, piece) for t in unit]
            piece += 1
        if row_len - len(cur) < 2:
            close()
    close()
    out: dict[str, list[list[int]]] = {k: [] for k in PACKED_KEYS}
    for row in rows:
        pieces = [p for _, p in row]
        order = {p: k for k, p in enumerate(dict.fromkeys(p for p in pieces if p >= 0))}
        doc = [order[p] if p >= 0 else len(order) for p in pieces]
        pos, labels = [], []
        for j in range(seq_len):
            pos.append(0 if j == 0 or doc[j] != doc[j - 1] else pos[-1] + 1)
            same = doc[j + 1] == doc[j] and pieces[j] >= 0
            labels.append(row[j + 1][0] if same else -100)
        out["input_ids"].append([t for t, _ in row[:seq_len]])
        out["labels"].append(labels)
        out["position_ids"].append(pos)
        out["document_ids"].append(doc[:seq_len])
    return out


def _random_docs(rng: random.Random, n: int, max_len: int) -> list[list[int]]:
    return [[rng.randrange(1, 50) for _ in range(rng.choice([0, 1, 2, rng.randrange(max_len + 1)]))] for _ in range(n)]


@pytest.mark.parametrize("mode", ["split", "truncate"])
@pytest.mark.parametrize("seed", range(6))
def test_pack_documents_matches_reference(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    seq_len = rng.choice([1, 2, 5, 8, 16])
    docs = _random_docs(rng, rng.randrange(0, 12), 3 * seq_len)
    got = pack_documents(docs, seq_len, EOS, long_documents=mode)
    want = _reference_pack(docs, seq_len, EOS, mode)
    for key in PACKED_KEYS:
        assert got[key].dtype == torch.int64 and got[key].shape == (len(want["input_ids"]), seq_len)
        assert got[key].tolist() == want[key], key
    check_packed_batch(got)


@pytest.mark.parametrize("seed", range(4))
def test_split_uses_every_label_of_every_document_once(seed: int) -> None:
    rng = random.Random(100 + seed)
    seq_len = 7
    docs = [[rng.randrange(1, 9) for _ in range(rng.randrange(0, 40))] for _ in range(8)]
    b = pack_documents(docs, seq_len, EOS)
    keep = b["labels"] != -100
    got = sorted(zip(b["input_ids"][keep].tolist(), b["labels"][keep].tolist()))
    want = sorted(p for d in docs if d for p in zip(d + [EOS], (d + [EOS])[1:]))
    assert got == want


def test_layout_example() -> None:
    b = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12]], seq_len=8, eos_id=EOS)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 4, 5, 0, 0], [6, 7, 8, 9, 10, 11, 12, 0]]
    assert b["labels"].tolist() == [[2, 3, 0, -100, 5, 0, -100, -100], [7, 8, 9, 10, 11, 12, 0, -100]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0] * 8]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], list(range(8))]


def test_degenerate_inputs() -> None:
    empty = pack_documents([], seq_len=4, eos_id=EOS)
    assert all(empty[k].shape == (0, 4) for k in PACKED_KEYS)
    assert pack_documents([[], []], seq_len=4, eos_id=EOS)["input_ids"].shape == (0, 4)
    exact = pack_documents([[1, 2, 3, 4]], seq_len=4, eos_id=EOS)  # document + EOS = seq_len + 1
    assert exact["input_ids"].tolist() == [[1, 2, 3, 4]] and exact["labels"].tolist() == [[2, 3, 4, 0]]
    ones = pack_documents([[7]] * 5, seq_len=3, eos_id=EOS)
    assert ones["labels"].tolist() == [[0, -100, 0], [0, -100, 0], [0, -100, -100]]
    tensor_docs = pack_documents([torch.tensor([5, 6]), torch.tensor([7], dtype=torch.uint8)], seq_len=4, eos_id=9)
    assert tensor_docs["input_ids"].tolist() == [[5, 6, 9, 7]]


def test_long_document_error_names_index_and_length() -> None:
    with pytest.raises(ValueError, match=r"document 2 has 9 tokens \(10 with its EOS\).*seq_len \+ 1 = 6"):
        pack_documents([[1], [2, 3], list(range(1, 10))], seq_len=5, eos_id=EOS, long_documents="error")
    fits = pack_documents([list(range(1, 6))], seq_len=5, eos_id=EOS, long_documents="error")  # 5 + EOS = a row
    assert fits["input_ids"].tolist() == [[1, 2, 3, 4, 5]] and fits["labels"].tolist() == [[2, 3, 4, 5, 0]]
    with pytest.raises(ValueError, match="long_documents='cut' is unknown"):
        pack_documents([[1]], seq_len=4, eos_id=EOS, long_documents="cut")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="document 0 has shape"):
        pack_documents([torch.ones(2, 2, dtype=torch.long)], seq_len=4, eos_id=EOS)
    with pytest.raises(ValueError, match="eos_id=-1"):
        pack_documents([[1]], seq_len=4, eos_id=-1)


def test_position_ids_from_document_ids() -> None:
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0], [3, 4, 4, 5, 5, 5]])
    assert position_ids_from_document_ids(doc).tolist() == [[0, 1, 0, 1, 2, 0], list(range(6)), [0, 0, 1, 0, 1, 2]]
    assert position_ids_from_document_ids(torch.empty(0, 5, dtype=torch.long)).shape == (0, 5)


def test_document_ids_from_lengths() -> None:
    assert document_ids_from_lengths([[2, 1, 3], [6]], 6).tolist() == [[0, 0, 1, 2, 2, 2], [0] * 6]
    with pytest.raises(ValueError, match=r"row 1 has document lengths \[2, 3\] \(sum 5\).*seq_len=6"):
        document_ids_from_lengths([[6], [2, 3]], 6)
    with pytest.raises(ValueError, match="row 0"):
        document_ids_from_lengths([[0, 6]], 6)


def _good_batch() -> dict[str, torch.Tensor]:
    return pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12]], seq_len=8, eos_id=EOS)


def test_check_packed_batch_rejects_inconsistent_batches() -> None:
    check_packed_batch(_good_batch())
    check_packed_batch({k: v[:0] for k, v in _good_batch().items()})  # zero rows
    cases: list[tuple[str, object, str]] = [
        ("document_ids", lambda d: d.flip(1), "document_ids decrease in row 0"),
        ("document_ids", lambda d: d - 1, "is negative"),
        ("position_ids", lambda p: p.index_put_((torch.tensor([0]), torch.tensor([4])), torch.tensor(4)),
         r"position_ids\[0, 4\]=4 but that token is at 0"),
        ("position_ids", lambda p: torch.arange(8).expand(2, 8).clone(), r"position_ids\[0, 4\]"),
        ("labels", lambda l: l.index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(4)),
         r"labels\[0, 3\]=4 is the next document's token"),
        ("position_ids", lambda p: p.float(), "position_ids is torch.float32"),
        ("document_ids", lambda d: d[:, :-1], r"document_ids has shape \[2, 7\]"),
        ("input_ids", lambda x: x[0], r"input_ids has shape \[8\]"),
    ]  # fmt: skip
    for key, change, message in cases:
        batch = _good_batch()
        batch[key] = change(batch[key].clone())  # type: ignore[operator]
        with pytest.raises(ValueError, match=message):
            check_packed_batch(batch)
    batch = _good_batch()
    del batch["position_ids"]
    with pytest.raises(ValueError, match=r"lacks \['position_ids'\]"):
        check_packed_batch(batch)


def test_check_packed_batch_continued_rows() -> None:
    b = _good_batch()
    shard = {k: v[:, 2:] for k, v in b.items()}  # rows cut mid-document
    with pytest.raises(ValueError, match=r"position_ids\[0, 0\]=2 but that token is at 0"):
        check_packed_batch(shard)
    check_packed_batch(shard, continued_rows=True)
    shard["position_ids"][1, 3] += 1
    with pytest.raises(ValueError, match=r"position_ids\[1, 3\]"):
        check_packed_batch(shard, continued_rows=True)


def test_packed_dataset_documents_end_at_eos() -> None:
    stream = torch.tensor([0, 1, 2, 3, 0, 0, 4, 5, 0, 6, 7], dtype=torch.uint8)
    ds = PackedDataset(stream, seq_len=4, eos_id=0)
    # Runs: [0] (empty), [1 2 3 0], [0] (empty), [4 5 0], [6 7] (no EOS: packed without one).
    assert len(ds) == 2 and ds.num_documents == 3
    assert ds[0]["input_ids"].tolist() == [1, 2, 3, 0] and ds[0]["labels"].tolist() == [2, 3, 0, -100]
    assert ds[1]["input_ids"].tolist() == [4, 5, 0, 6] and ds[1]["labels"].tolist() == [5, 0, -100, 7]
    assert ds[-1]["document_ids"].tolist() == [0, 0, 0, 1]
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(ValueError, match="no document with a label"):
        PackedDataset(torch.zeros(5, dtype=torch.long), seq_len=4, eos_id=0)
    with pytest.raises(ValueError, match="document 1 has 7 tokens"):
        PackedDataset(torch.tensor([1, 0, *range(1, 8), 0]), seq_len=4, eos_id=0, long_documents="error")


def test_datamodule_packs_folder_files_as_documents(tmp_path: Path) -> None:
    texts = [b"alpha beta\n" * 3, b"gamma\n", b"delta epsilon zeta eta theta\n" * 4]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_bytes(t)
    dm = MoEDataModule(path=str(tmp_path), seq_len=16, batch_size=2, val_fraction=0.2, max_bytes=None,
                       packing="pack", long_documents="split")  # fmt: skip
    dm.setup("fit")
    assert isinstance(dm.train_dataset, PackedDataset) and isinstance(dm.val_dataset, PackedDataset)
    files = [t + b"\x00" for t in texts]
    segments = 0
    for ds in (dm.train_dataset, dm.val_dataset):
        for i in range(len(ds)):
            row = ds[i]
            for d in row["document_ids"].unique().tolist():
                at = row["document_ids"] == d
                if not (row["labels"][at] != -100).any():
                    continue  # padding
                # A document of a row: its inputs, and the row's last token when it continues there.
                last = int(row["labels"][at][-1])
                text = bytes(row["input_ids"][at].tolist() + ([last] if last != -100 else []))
                assert any(text in f for f in files), text
                segments += 1
    assert segments >= len(texts)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == set(PACKED_KEYS)
    check_packed_batch(batch)


def test_datamodule_default_keys_unchanged_and_packed_loader_resumes() -> None:
    plain = MoEDataModule(seq_len=32, batch_size=4, max_bytes=60_000)
    plain.setup("fit")
    assert set(next(iter(plain.train_dataloader()))) == {"input_ids", "labels"}

    def loader() -> object:
        dm = MoEDataModule(seq_len=32, batch_size=4, max_bytes=60_000, packing="pack", seed=3)
        dm.setup("fit")
        return dm.train_dataloader()

    first = loader()
    it = iter(first)  # type: ignore[call-overload]
    seen = [next(it) for _ in range(3)]
    state = first.state_dict()  # type: ignore[attr-defined]
    rest = [next(it) for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    again = iter(resumed)  # type: ignore[call-overload]
    for want in rest:
        got = next(again)
        assert all(torch.equal(got[k], want[k]) for k in PACKED_KEYS)
    replay = iter(loader())  # type: ignore[call-overload]
    for want in seen:  # the same seed gives the same order
        assert torch.equal(next(replay)["input_ids"], want["input_ids"])
    for b in seen + rest:
        check_packed_batch(b)


def test_datamodule_rejects_bad_packing_options() -> None:
    with pytest.raises(ValueError, match="packing='yes' is unknown"):
        MoEDataModule(packing="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="long_documents='drop' is unknown"):
        MoEDataModule(packing="pack", long_documents="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eos_id=-1 must be an int >= 0"):
        MoEDataModule(packing="pack", eos_id=-1)
    with pytest.raises(ValueError, match="vocab_size=1000 needs eos_id"):
        MoEDataModule(packing="pack", vocab_size=1000)
    with pytest.raises(ValueError, match=r"eos_id=300 is outside the vocabulary \[0, vocab_size=256\)"):
        MoEDataModule(packing="pack", eos_id=300)
    dm = MoEDataModule(seq_len=64, batch_size=2, max_bytes=200_000, packing="pack", long_documents="error")
    with pytest.raises(ValueError, match=r"document \d+ has \d+ tokens"):
        dm.setup("fit")
