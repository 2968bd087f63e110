"""Token shards on disk: round trip against the in-memory tokenization, rows equal to TextDataModule's
in-memory rows, reuse and rebuild, crashes mid-write, resume, bad inputs, the byte fast path, the
saved-datasets reader and the constant-memory shuffle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from _corpus import WORDS, random_docs, write_jsonl
from _tiny_tokenizer import make_tiny_tokenizer
from lightning_moe.data.byte_codec import ByteCodec, byte_codec, encode_byte_batch, encode_bytes
from lightning_moe.data.permutation import feistel_permutation
from lightning_moe.data.sampler import ResumableSampler
from lightning_moe.data.sft import tokenize_chat
from lightning_moe.data.shard_cache import ShardSource, ensure_token_shards
from lightning_moe.data.shard_format import HEADER_NAME, check_shard_set, shard_file, token_dtype
from lightning_moe.data.shard_reader import TokenShards
from lightning_moe.data.shard_writer import ShardWriter
from lightning_moe.data.text import read_records
from lightning_moe.data.text_datamodule import TextDataModule
from lightning_moe.data.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "Fine, thank you."}]


@pytest.fixture(scope="module")
def byte_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import ByT5Tokenizer

    folder = tmp_path_factory.mktemp("byt5")
    ByT5Tokenizer().save_pretrained(folder)
    return folder


def _source(path: Path, task: str = "lm", field: str = "text") -> ShardSource:
    return ShardSource((str(path),), "auto", field, "file", task, None)


def _assert_same_items(a: TextDataModule, b: TextDataModule) -> None:
    for name in ("train_dataset", "val_dataset"):
        da, db = getattr(a, name), getattr(b, name)
        assert len(da) == len(db) > 0, name
        for i in range(len(da)):
            x, y = da[i], db[i]
            assert x.keys() == y.keys(), name
            for k in x:
                assert x[k].dtype == y[k].dtype == torch.int64 and torch.equal(x[k], y[k]), (name, i, k)


# --- shards --------------------------------------------------------------------------------------


def test_shards_hold_the_tokenizers_ids_document_by_document(tok_dir: Path, tmp_path: Path) -> None:
    docs = random_docs(40) + [""] + random_docs(5, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    tok = load_tokenizer(tok_dir)
    folder = ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir, shard_tokens=50)
    shards = TokenShards(folder)
    assert shards.dtype == np.uint16 and shards.documents == len(docs) and len(shards.header["shards"]) > 3
    ref = [tok(d)["input_ids"] for d in docs]
    assert [shards.document(i).tolist() for i in range(len(docs))] == ref
    assert [n for chunk in shards.lengths() for n in chunk.tolist()] == [len(r) for r in ref]
    assert shards.tokens == sum(len(r) for r in ref)
    assert shards.unit(3, 1, len(ref[3]), eos_id=7).tolist() == [*ref[3][1:], 7]


def test_chat_shards_keep_the_assistant_masks(tok_dir: Path, tmp_path: Path) -> None:
    brief = [{"role": "system", "content": "Be brief."}, *CHAT]
    chats = [CHAT, brief, CHAT[:1] + [{"role": "assistant", "content": "Ok."}]]
    data = write_jsonl(tmp_path / "c.jsonl", chats, field="messages")
    tok = load_tokenizer(tok_dir)
    shards = TokenShards(ensure_token_shards(tmp_path / "cache", _source(data, "sft", "messages"), tok, tok_dir))
    for i, chat in enumerate(chats):
        ids, mask = tokenize_chat(tok, chat)
        assert shards.document(i).tolist() == ids and shards.mask(i).tolist() == mask


def test_shards_are_reused_and_rebuilt_when_the_source_changes(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(10))
    tok = load_tokenizer(tok_dir)
    folder = ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir)
    written = (folder / HEADER_NAME).stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir) == folder
    assert (folder / HEADER_NAME).stat().st_mtime_ns == written
    write_jsonl(data, random_docs(12, seed=5))
    with pytest.warns(UserWarning, match="rebuilding the token shards .*the source changed"):
        ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir)
    assert TokenShards(folder).documents == 12


def test_a_new_tokenizer_in_the_same_folder_rebuilds(tmp_path: Path) -> None:
    tok_dir = make_tiny_tokenizer(tmp_path / "tok", vocab_size=400)
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(10))
    folder = ensure_token_shards(tmp_path / "cache", _source(data), load_tokenizer(tok_dir), tok_dir)
    make_tiny_tokenizer(tmp_path / "tok", vocab_size=300)
    tok = load_tokenizer(tok_dir)
    with pytest.warns(UserWarning, match="the tokenizer changed"):
        ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir)
    assert TokenShards(folder).document(0).tolist() == tok(random_docs(10)[0])["input_ids"]


def test_an_exception_mid_write_leaves_no_set_and_the_next_run_builds(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(30))
    tok = load_tokenizer(tok_dir)
    add = ShardWriter.add

    def failing_add(self: ShardWriter, *args: object, **kwargs: object) -> None:
        if self.documents == 20:
            raise OSError("disk full")
        add(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(OSError, match="disk full"):
        ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir, shard_tokens=16)
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder is gone, nothing installed
    monkeypatch.setattr(ShardWriter, "add", add)
    folder = ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir, shard_tokens=16)
    assert TokenShards(folder).documents == 30


def test_a_killed_writer_leaves_nothing_that_looks_complete(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(30))
    cache = tmp_path / "cache"
    child = textwrap.dedent(f"""
        import os, signal
        from lightning_moe.data.shard_cache import ShardSource, ensure_token_shards
        from lightning_moe.data.shard_writer import ShardWriter
        from lightning_moe.data.tokenizer import load_tokenizer
        add = ShardWriter.add
        def dying_add(self, *args, **kwargs):
            if self.documents == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            add(self, *args, **kwargs)
        ShardWriter.add = dying_add
        source = ShardSource(({str(data)!r},), "auto", "text", "file", "lm", None)
        ensure_token_shards({str(cache)!r}, source, load_tokenizer({str(tok_dir)!r}), {str(tok_dir)!r}, shard_tokens=16)
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr
    left = list(cache.iterdir())
    assert len(left) == 1 and ".tmp-" in left[0].name and not (left[0] / HEADER_NAME).exists()
    assert any(p.name.endswith(".partial") for p in left[0].iterdir())  # the open shard never got its name
    folder = ensure_token_shards(cache, _source(data), load_tokenizer(tok_dir), tok_dir, shard_tokens=16)
    assert [p.name for p in cache.iterdir()] == [folder.name]  # the dead writer's folder was removed
    assert TokenShards(folder).documents == 30


def test_a_truncated_shard_is_detected_and_rebuilt(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(30))
    tok = load_tokenizer(tok_dir)
    folder = ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir, shard_tokens=16)
    path = folder / shard_file("tokens", 1)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.warns(UserWarning, match=r"tokens-00001\.bin is \d+ bytes, the header says"):
        ensure_token_shards(tmp_path / "cache", _source(data), tok, tok_dir, shard_tokens=16)
    assert check_shard_set(folder, {}) is None
    assert TokenShards(folder).document(29).tolist() == tok(random_docs(30)[29])["input_ids"]


# --- TextDataModule(cache_dir=...) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"packing": "none"}, {"long_documents": "truncate"}, {"packing": "none", "long_documents": "truncate"},
     {"val_fraction": 0.3, "seed": 4}, {"max_documents": 90}],
)  # fmt: skip
def test_rows_from_shards_equal_the_in_memory_rows(tok_dir: Path, tmp_path: Path, kwargs: dict) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(200, hi=20) + [""] + random_docs(40, seed=2))
    common = {"seq_len": 16, "batch_size": 4, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncate warning
        memory = TextDataModule(str(tok_dir), str(data), **common)
        memory.setup()
        sharded = TextDataModule(str(tok_dir), str(data), cache_dir=str(tmp_path / "cache"), **common)
        sharded.setup()
    _assert_same_items(memory, sharded)


def test_sft_rows_and_validation_files_from_shards(tok_dir: Path, tmp_path: Path) -> None:
    chats = [CHAT, [{"role": "system", "content": "Be brief."}, *CHAT]] * 6
    data = write_jsonl(tmp_path / "c.jsonl", chats, field="messages")
    for packing in ("pack", "none"):
        common = {"val_files": str(data), "task": "sft", "seq_len": 24, "batch_size": 2, "packing": packing}
        memory = TextDataModule(str(tok_dir), str(data), **common)
        memory.setup()
        sharded = TextDataModule(str(tok_dir), str(data), cache_dir=str(tmp_path / "cache"), **common)
        sharded.setup()
        _assert_same_items(memory, sharded)


def test_packing_in_chunks_matches_in_memory(tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.data.text_datamodule as tdm

    monkeypatch.setattr(tdm, "PACK_CHUNK_TOKENS", 40)
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(100))
    memory = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=2)
    memory.setup()
    sharded = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=2, cache_dir=str(tmp_path / "c"))
    sharded.setup()
    _assert_same_items(memory, sharded)


def test_long_documents_and_empty_splits_are_refused_naming_the_record(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(5, hi=3) + [" ".join(WORDS * 3)])
    dm = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1,
                        long_documents="error", cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ValueError, match=r"d\.jsonl:6 has more tokens than seq_len=16 \(1 such"):
        dm.setup()
    with pytest.warns(UserWarning, match=r"1 document\(s\) longer than seq_len=16.*d\.jsonl:6"):
        TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1,
                       long_documents="truncate", cache_dir=str(tmp_path / "cache")).setup()  # fmt: skip
    one = write_jsonl(tmp_path / "one.jsonl", ["a b c"])
    dm = TextDataModule(str(tok_dir), str(one), seq_len=8, batch_size=1, val_fraction=0.01,
                        cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ValueError, match="the validation split holds no document"):
        dm.setup()


def test_resume_mid_epoch_gives_the_same_next_batches(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(300))

    def loader(cache: bool):  # noqa: ANN202
        dm = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=3, seed=7,
                            cache_dir=str(tmp_path / "cache") if cache else None)  # fmt: skip
        dm.prepare_data()
        dm.setup()
        return dm.train_dataloader()

    whole = list(loader(True))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(whole, loader(False)) for k in a)  # same order as in memory
    first = loader(True)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    resumed = loader(True)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 5
    assert all(torch.equal(a[k], b[k]) for a, b in zip(rest, whole[5:]) for k in a)


def test_workers_read_the_shards_themselves(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(120))
    kwargs = {"seq_len": 16, "batch_size": 4, "cache_dir": str(tmp_path / "cache")}
    dm = TextDataModule(str(tok_dir), str(data), **kwargs)
    dm.setup()
    ref = list(dm.train_dataloader())
    dm2 = TextDataModule(str(tok_dir), str(data), num_workers=2, **kwargs)
    dm2.setup()
    got = list(dm2.train_dataloader())
    assert len(got) == len(ref) and all(torch.equal(a[k], b[k]) for a, b in zip(got, ref) for k in a)


def test_a_trainer_fits_from_the_shards(tok_dir: Path, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_moe.data.shard_rows import ShardRowsDataset

    class TinyLM(pl.LightningModule):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

        def training_step(self, batch: dict, index: int) -> torch.Tensor:
            logits = self.head(self.embed(batch["input_ids"]))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def validation_step(self, batch: dict, index: int) -> None:
            self.log("val_loss", self.training_step(batch, index))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = write_jsonl(tmp_path / "d.jsonl", random_docs(200))
    dm = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyLM(dm.vocab_size), datamodule=dm)
    assert trainer.global_step == 3 and isinstance(dm.train_dataset, ShardRowsDataset)
    assert trainer.train_dataloader.state_dict()["consumed"] == 12
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()) == ["rows", "tokens"]


# --- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_are_refused_clearly(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        TextDataModule(str(tok_dir), str(tmp_path / "missing.jsonl"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unknown extension '\.csv'.*format='text'"):
        TextDataModule(str(tok_dir), str(tmp_path / "data.csv"), cache_dir=str(tmp_path / "cache"))
    assert [r.value for r in read_records(tmp_path / "data.csv", format="text")] == ["a,b\n"]
    with pytest.raises(ValueError, match="cache_dir=''"):
        TextDataModule(str(tok_dir), str(write_jsonl(tmp_path / "d.jsonl", ["a"])), cache_dir="")
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    with pytest.raises(ValueError, match=r"vocab_size=4294967296 has ids beyond uint32"):
        token_dtype(1 << 32)
    with ShardWriter(tmp_path / "s", vocab_size=300, dtype=token_dtype(300), has_masks=False, shard_tokens=8) as w:
        with pytest.raises(ValueError, match=r"d\.txt:3: token id 300 is outside the vocabulary \[0, 300\)"):
            w.add(np.array([1, 300]), where="d.txt:3")
        w.discard()


# --- byte-level fast path ------------------------------------------------------------------------


def test_byte_fast_path_equals_the_tokenizer(byte_tok_dir: Path, tok_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(byte_tok_dir)
    codec = byte_codec(tok)
    assert codec is not None and byte_codec(load_tokenizer(tok_dir)) is None  # a BPE with merges has none
    texts = ["", "plain words", "héllo wörld 日本語 🙂", "tabs\tand\nnewlines  ", "a </s> inside"]
    for text in texts:
        fast = encode_bytes(codec, text)
        assert fast is None if "<" in text else fast.tolist() == tok(text)["input_ids"], text
    data = write_jsonl(tmp_path / "d.jsonl", texts[1:] + random_docs(50))
    shards = TokenShards(ensure_token_shards(tmp_path / "cache", _source(data), tok, byte_tok_dir, shard_tokens=64))
    assert shards.header["fast_path"] == "bytes" and len(shards.header["shards"]) > 5
    assert [shards.document(i).tolist() for i in range(shards.documents)] == [
        tok(t)["input_ids"] for t in texts[1:] + random_docs(50)
    ]


@pytest.mark.parametrize(("prefix", "suffix"), [([], [1]), ([9], []), ([9, 8], [1, 2]), ([], [])])
@pytest.mark.parametrize("table", ["offset", "lookup"])
def test_byte_batches_equal_one_document_at_a_time(prefix: list, suffix: list, table: str) -> None:
    ids = np.arange(256) + 3 if table == "offset" else np.random.default_rng(0).permutation(256) + 300
    codec = ByteCodec(ids, np.array(prefix, dtype=np.int64), np.array(suffix, dtype=np.int64), "")
    for texts in (["ab", "", "héllo", "x"], ["", "", "a", ""], [""], ["日本語 🙂"]):
        got, lengths = encode_byte_batch(codec, [t.encode() for t in texts], np.dtype("<u2"))
        ref = [encode_bytes(codec, t).tolist() for t in texts]
        assert got.dtype == np.uint16 and got.tolist() == [i for r in ref for i in r], texts
        assert lengths.tolist() == [len(r) for r in ref]
        assert ref[0][: len(prefix)] == prefix and ref[0][len(ref[0]) - len(suffix) :] == suffix


def test_a_fast_path_that_disagrees_with_the_tokenizer_is_dropped(
    byte_tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_moe.data.shard_cache as shard_cache

    tok = load_tokenizer(byte_tok_dir)
    good = byte_codec(tok)
    wrong = good._replace(table=np.where(good.table >= 0, good.table + 1, -1))  # every id one too high
    monkeypatch.setattr(shard_cache, "byte_codec", lambda tokenizer: wrong)
    docs = random_docs(20)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    with pytest.warns(UserWarning, match=r"fast path disagrees with the tokenizer at .*d\.jsonl:1"):
        folder = ensure_token_shards(tmp_path / "cache", _source(data), tok, byte_tok_dir)
    shards = TokenShards(folder)
    assert shards.header["fast_path"] is None
    assert [shards.document(i).tolist() for i in range(20)] == [tok(d)["input_ids"] for d in docs]


def test_parquet_rows_from_shards(tok_dir: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": random_docs(60)}), tmp_path / "d.parquet")
    common = {"val_files": str(tmp_path / "d.parquet"), "seq_len": 16, "batch_size": 2}
    memory = TextDataModule(str(tok_dir), str(tmp_path / "d.parquet"), **common)
    memory.setup()
    sharded = TextDataModule(str(tok_dir), str(tmp_path / "d.parquet"), cache_dir=str(tmp_path / "cache"), **common)
    sharded.setup()
    _assert_same_items(memory, sharded)


# --- saved datasets ------------------------------------------------------------------------------


def test_saved_dataset_folder_is_read_by_rows(tok_dir: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    docs = random_docs(20)
    table = datasets.table.InMemoryTable(pa.table({"text": docs, "n": list(range(20))}))
    datasets.Dataset(table, fingerprint="fixed").save_to_disk(str(tmp_path / "ds"))
    got = list(read_records(tmp_path / "ds"))
    assert [r.value for r in got] == docs and got[3].where == f"{tmp_path / 'ds'}:row 3"
    with pytest.raises(ValueError, match="has no column 'body'"):
        list(read_records(tmp_path / "ds", field="body"))
    memory = TextDataModule(str(tok_dir), str(tmp_path / "ds"), val_files=str(tmp_path / "ds"), seq_len=16,
                            batch_size=2)  # fmt: skip
    memory.setup()
    sharded = TextDataModule(str(tok_dir), str(tmp_path / "ds"), val_files=str(tmp_path / "ds"), seq_len=16,
                             batch_size=2, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    sharded.setup()
    _assert_same_items(memory, sharded)


def test_saved_dataset_without_the_package_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (folder / name).write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"needs the datasets package.*pip install datasets"):
        list(read_records(folder))
    with pytest.raises(ValueError, match="not a folder that datasets' save_to_disk wrote"):
        read_records(tmp_path, format="datasets")


def test_saved_dataset_dict_names_its_splits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    folder = tmp_path / "dd"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    fake = SimpleNamespace(load_from_disk=lambda path: {"train": None, "test": None})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(ValueError, match=r"holds a DatasetDict \(splits \['test', 'train'\]\); pass one split"):
        list(read_records(folder))


# --- constant-memory order -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_feistel_permutation_is_a_permutation(n: int) -> None:
    got = feistel_permutation(np.arange(n), n, key=11)
    assert sorted(got.tolist()) == list(range(n))
    assert n < 17 or got.tolist() != list(range(n))
    assert np.array_equal(feistel_permutation(np.arange(5, n), n, key=11), got[5:])


def test_feistel_order_shards_and_resumes_like_randperm() -> None:
    class Rows:
        def __len__(self) -> int:
            return 3001

    whole = ResumableSampler(Rows(), num_replicas=1, seed=2)
    whole.order_kind = "feistel"
    order = list(whole)
    assert sorted(order) == list(range(3001)) and order == whole.global_order().tolist()
    ranks = []
    for rank in range(3):
        s = ResumableSampler(Rows(), num_replicas=3, rank=rank, seed=2)
        s.order_kind = "feistel"
        s.start = 300
        ranks.append(list(s))
    assert [i for triple in zip(*ranks) for i in triple] == order[300:3000]
