"""Text data: streaming readers (text, jsonl, parquet), local tokenizers, and TextDataModule's rows, split,
truncation and resumable order against plain references built from the tokenizer and pack_documents."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from _corpus import WORDS, random_docs, write_jsonl
from _tiny_tokenizer import SPECIAL_TOKENS
from lightning_moe.data.packing import IGNORE_INDEX, check_packed_batch, pack_documents
from lightning_moe.data.text import read_records
from lightning_moe.data.text_datamodule import TextDataModule, build_rows
from lightning_moe.data.tokenizer import CHAT_SPECIAL_TOKENS, eos_token_id, load_tokenizer, train_bpe_tokenizer


# --- readers -------------------------------------------------------------------------------------


def test_text_units_and_where(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one line\nsecond line\n\n\nthird\nfourth\n")
    assert [r.value for r in read_records(f, text_unit="file")] == ["one line\nsecond line\n\n\nthird\nfourth\n"]
    lines = list(read_records(f, text_unit="line"))
    assert [r.value for r in lines] == ["one line", "second line", "third", "fourth"]
    assert [r.where for r in lines] == [f"{f}:1", f"{f}:2", f"{f}:5", f"{f}:6"]
    paras = list(read_records(f, text_unit="paragraph"))
    assert [(r.value, r.where) for r in paras] == [("one line\nsecond line", f"{f}:1"), ("third\nfourth", f"{f}:5")]


def test_folder_is_read_sorted_and_formats_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "sub" / "a.txt").write_text("sub a")
    (tmp_path / "a.jsonl").write_text('{"text": "jay"}\n\n{"text": "kay"}\n')
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    assert [r.value for r in read_records(tmp_path)] == ["jay", "kay", "bee", "sub a"]
    assert [r.value for r in read_records(tmp_path, format="text")] == ["bee", "sub a"]


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n\n{"body": "x"}\n')
    records = read_records(f)
    assert next(records).value == "fine"  # streamed: the good line comes out before the bad one is read
    with pytest.raises(ValueError, match=r"d\.jsonl:3 has no field 'text' \(keys: \['body'\]\)"):
        next(records)
    f.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2 is not valid JSON"):
        list(read_records(f))
    f.write_text('["a list"]\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:1 holds a JSON list, not an object"):
        list(read_records(f))


def test_non_utf8_file_is_refused_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text"):
        list(read_records(f, text_unit="line"))


def test_bad_paths_and_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="holds no"):
        read_records(tmp_path)
    with pytest.raises(ValueError, match="format='csv' is unknown"):
        read_records(tmp_path, format="csv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text_unit='page' is unknown"):
        read_records(tmp_path, text_unit="page")  # type: ignore[arg-type]


def test_parquet_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"], "n": [1, 2, 3]}), f)
    assert [(r.value, r.where) for r in read_records(f)] == [("a", f"{f}:row 0"), ("b", f"{f}:row 1"),
                                                             ("c", f"{f}:row 2")]  # fmt: skip
    with pytest.raises(ValueError, match="has no column 'body'"):
        list(read_records(f, field="body"))


def test_parquet_without_pyarrow_is_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "d.parquet"
    f.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"needs pyarrow.*pip install pyarrow"):
        list(read_records(f))


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_from_a_local_folder(tok_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tok_dir)
    assert len(tok) == 400 and eos_token_id(tok) == SPECIAL_TOKENS.index("<|endoftext|>")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        TextDataModule(str(tmp_path), str(write_jsonl(tmp_path / "d.jsonl", ["a b"], ids=True))).setup()



def test_train_bpe_tokenizer_encodes_any_text_and_marks_assistant_turns(tmp_path: Path) -> None:
    texts = ["Experts route tokens. Routers pick the experts. " * 20, "Hello, how are you? Fine, thank you. " * 20]
    tok = train_bpe_tokenizer(texts, vocab_size=320)
    assert tok.convert_ids_to_tokens(list(range(6))) == list(CHAT_SPECIAL_TOKENS)
    assert (tok.pad_token_id, eos_token_id(tok)) == (0, 1) and 262 < len(tok) <= 320
    odd = "naïve façade — 日本語 \t tabs 0123"
    assert tok.decode(tok(odd)["input_ids"]) == odd  # byte-level: nothing is unknown
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"}]  # fmt: skip
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello there<|end|>"
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    out = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(marked) == "Hello there<|end|>"
    tok.save_pretrained(tmp_path / "tok")
    back = load_tokenizer(tmp_path / "tok")
    assert back.chat_template == tok.chat_template and back(odd)["input_ids"] == tok(odd)["input_ids"]
    plain = train_bpe_tokenizer(texts, vocab_size=320, generation=False)
    assert "{% generation %}" not in plain.chat_template and plain.apply_chat_template(chat, tokenize=False) == text


def test_train_bpe_tokenizer_refuses_bad_sizes_and_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (100, 261, 300.0, True):
        with pytest.raises(ValueError, match=r"vocab_size=.* must be an int >= 262"):
            train_bpe_tokenizer(["a b c"], vocab_size=bad)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"needs the tokenizers and transformers .* 'lightning-moe\[hf\]'"):
        train_bpe_tokenizer(["a b c"])

# --- TextDataModule ------------------------------------------------------------------------------


def test_packed_rows_equal_pack_documents_of_the_tokenized_texts(tok_dir: Path, tmp_path: Path) -> None:
    docs = random_docs(30, lo=2, hi=9)
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)
    dm = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=4)
    dm.setup()
    tok = load_tokenizer(tok_dir)
    ref = pack_documents([tok(d)["input_ids"] for d in docs], 16, tok.eos_token_id)
    got = {k: v.long() for k, v in dm.train_dataset.rows.items()}
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    batch = next(iter(dm.train_dataloader()))
    check_packed_batch(batch)
    assert batch["input_ids"].shape == (4, 16) and dm.vocab_size == len(tok)


def test_unpacked_rows_hold_one_document_each(tok_dir: Path, tmp_path: Path) -> None:
    docs = random_docs(12, lo=2, hi=9)
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)
    dm = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=2, packing="none")
    dm.setup()
    tok = load_tokenizer(tok_dir)
    rows = dm.train_dataset.rows
    assert set(rows) == {"input_ids", "labels"} and rows["input_ids"].shape == (12, 16)
    for r, d in enumerate(docs):
        ids = [*tok(d)["input_ids"], tok.eos_token_id]
        n = len(ids) - 1
        assert rows["input_ids"][r, :n].tolist() == ids[:-1] and rows["labels"][r, :n].tolist() == ids[1:]
        assert torch.all(rows["labels"][r, n:] == IGNORE_INDEX)


def test_held_out_split_is_fixed_by_the_seed(tok_dir: Path, tmp_path: Path) -> None:
    docs = [f"{WORDS[i % 16]} {i}" for i in range(60)]  # each document different
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)

    def split(seed: int) -> tuple[set, set]:
        dm = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=2, packing="none", val_fraction=0.25,
                            seed=seed)  # fmt: skip
        dm.setup()
        return ({tuple(r.tolist()) for r in dm.train_dataset.rows["input_ids"]},
                {tuple(r.tolist()) for r in dm.val_dataset.rows["input_ids"]})  # fmt: skip

    train, val = split(0)
    assert not train & val and len(train) + len(val) == 60 and 5 <= len(val) <= 25
    assert split(0) == (train, val)
    assert split(1)[1] != val


def test_empty_validation_split_is_refused(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["a b c"], ids=True)
    dm = TextDataModule(str(tok_dir), str(data), seq_len=8, batch_size=1, val_fraction=0.01)
    with pytest.raises(ValueError, match="the validation split holds no document"):
        dm.setup()


def test_long_documents_truncate_with_a_warning_split_or_error(tok_dir: Path, tmp_path: Path) -> None:
    docs = random_docs(10, lo=2, hi=4) + [" ".join(WORDS * 3)]
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)
    tok = load_tokenizer(tok_dir)
    ids = [tok(d)["input_ids"] for d in docs]
    assert len(ids[-1]) > 16 and all(len(i) <= 16 for i in ids[:-1])

    def dm(mode: str) -> TextDataModule:
        return TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1,
                              long_documents=mode)  # fmt: skip

    with pytest.warns(UserWarning, match=r"1 document\(s\) longer than seq_len=16.*d\.jsonl:11"):
        truncated = dm("truncate")
        truncated.setup()
    assert int((truncated.train_dataset.rows["labels"] != IGNORE_INDEX).sum()) == sum(len(i) for i in ids[:-1]) + 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = dm("split")
        split.setup()
    assert int((split.train_dataset.rows["labels"] != IGNORE_INDEX).sum()) == sum(len(i) for i in ids)
    with pytest.raises(ValueError, match=r"d\.jsonl:11 has more tokens than seq_len=16"):
        dm("error").setup()


def test_resumed_loader_continues_with_the_next_batch(tok_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", random_docs(60, lo=2, hi=9), ids=True)

    def loader():  # noqa: ANN202
        dm = TextDataModule(str(tok_dir), str(data), seq_len=16, batch_size=2, seed=3)
        dm.setup()
        return dm.train_dataloader()

    first = loader()
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    state = first.state_dict()
    expected = next(it)
    resumed = loader()
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(got["input_ids"], seen[0]["input_ids"])


def test_text_files_as_documents(tok_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "corpus.txt"
    paras = random_docs(20, lo=2, hi=9)
    f.write_text("\n\n".join(paras) + "\n")
    dm = TextDataModule(str(tok_dir), str(f), val_files=str(f), text_unit="paragraph", seq_len=32, batch_size=2)
    dm.setup()
    tok = load_tokenizer(tok_dir)
    ref = pack_documents([tok(p)["input_ids"] for p in paras], 32, tok.eos_token_id)
    assert torch.equal(dm.val_dataset.rows["input_ids"].long(), ref["input_ids"])


def test_max_documents_caps_the_records(tok_dir: Path, tmp_path: Path) -> None:
    docs = random_docs(20, lo=2, hi=9)
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)
    dm = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1, packing="none",
                        max_documents=5)  # fmt: skip
    dm.setup()
    assert len(dm.train_dataset) == 5 and len(dm.val_dataset) == 5


def test_bad_arguments_are_refused_early(tok_dir: Path, tmp_path: Path) -> None:
    data = str(write_jsonl(tmp_path / "d.jsonl", ["a b"], ids=True))
    for kwargs, match in (
        ({"task": "chat"}, "task='chat' is unknown"),
        ({"packing": "tight"}, "packing='tight' is unknown"),
        ({"long_documents": "drop"}, "long_documents='drop' is unknown"),
        ({"seq_len": 0}, "seq_len=0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"field": ""}, "field=''"),
    ):
        with pytest.raises(ValueError, match=match):
            TextDataModule(str(tok_dir), data, **kwargs)
    with pytest.raises(ValueError, match="does not exist"):
        TextDataModule(str(tok_dir), str(tmp_path / "missing.jsonl"))


def test_build_rows_with_no_documents_is_empty() -> None:
    rows = build_rows([], None, 8, 1, "pack")
    assert rows["input_ids"].shape == (0, 8) and set(rows) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert build_rows([], None, 8, 1, "none")["labels"].shape == (0, 8)


def test_packing_in_chunks_keeps_every_label(tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_moe.data.text_datamodule as tdm

    docs = random_docs(40, lo=2, hi=9)
    data = write_jsonl(tmp_path / "d.jsonl", docs, ids=True)
    whole = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1)
    whole.setup()
    monkeypatch.setattr(tdm, "PACK_CHUNK_TOKENS", 1)  # every document a chunk: a row (or more) each
    chunked = TextDataModule(str(tok_dir), str(data), val_files=str(data), seq_len=16, batch_size=1)
    chunked.setup()
    rows, ref = chunked.train_dataset.rows, whole.train_dataset.rows
    check_packed_batch({k: v.long() for k, v in rows.items()})
    assert len(chunked.train_dataset) >= 40 > len(whole.train_dataset)
    labelled = rows["labels"][rows["labels"] != IGNORE_INDEX]
    assert labelled.tolist() == ref["labels"][ref["labels"] != IGNORE_INDEX].tolist()


@pytest.mark.parametrize("long_documents", ["split", "truncate"])
@pytest.mark.parametrize("sft", [False, True])
def test_one_document_per_row_equals_pack_documents_of_each_alone(long_documents: str, sft: bool) -> None:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, 50, (int(n),), generator=g) for n in (3, 0, 7, 8, 9, 20, 1, 16, 17, 33)]
    masks = [torch.randint(0, 2, (d.numel(),), generator=g) for d in docs] if sft else None
    got = build_rows(docs, masks, 8, 1, "none", long_documents)
    ref_rows = []
    for i, d in enumerate(docs):
        if d.numel() == 0:
            continue
        rows = pack_documents([d], 8, 1, long_documents)
        if sft:
            keep = pack_documents([masks[i]], 8, 0, long_documents)["labels"] == 1
            rows["labels"] = torch.where(keep, rows["labels"], IGNORE_INDEX)
        ref_rows.append(rows)
    for k in ("input_ids", "labels"):
        assert torch.equal(got[k], torch.cat([r[k] for r in ref_rows])), k
    with pytest.raises(ValueError, match=r"document 4 has 9 tokens \(10 with its EOS\)"):
        build_rows(docs, masks, 8, 1, "none", "error")


def test_tokenizer_without_eos_is_refused_for_packing() -> None:
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="has no eos_token"):
        eos_token_id(SimpleNamespace(eos_token_id=None))
    assert eos_token_id(SimpleNamespace(eos_token_id=[7, 8])) == 7
