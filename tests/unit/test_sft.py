"""SFT chats: the assistant mask from {% generation %} equals the one from rendered prefixes, labels only on
assistant tokens, masked tokens carry no loss and no gradient, and bad chats are refused with their file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from _tiny_tokenizer import make_tiny_tokenizer
from lightning_moe.data.packing import IGNORE_INDEX, check_packed_batch
from lightning_moe.data.sft import chat_example, has_generation_blocks, tokenize_chat
from lightning_moe.data.text_datamodule import TextDataModule
from lightning_moe.data.tokenizer import load_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I am fine."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    plain = make_tiny_tokenizer(tmp_path_factory.mktemp("plain"), generation=False)
    marked = make_tiny_tokenizer(tmp_path_factory.mktemp("marked"), generation=True)
    return {"plain": load_tokenizer(plain), "marked": load_tokenizer(marked), "plain_dir": plain}


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_prefix_rendering_equals_generation_blocks(tokenizers: dict) -> None:
    assert has_generation_blocks(tokenizers["marked"]) and not has_generation_blocks(tokenizers["plain"])
    ids_p, mask_p = tokenize_chat(tokenizers["plain"], CHAT)
    ids_m, mask_m = tokenize_chat(tokenizers["marked"], CHAT)
    assert ids_p == ids_m and mask_p == mask_m
    # the masked tokens are exactly the assistant replies with their end-of-turn marker
    tok = tokenizers["plain"]
    assistant = tok.decode([i for i, m in zip(ids_p, mask_p) if m])
    assert assistant == "I am fine.<|end|>Paris is the capital.<|end|>"
    others = tok.decode([i for i, m in zip(ids_p, mask_p) if not m])
    assert "Hello" in others and "Be brief" in others and "Paris" not in others


def test_chat_example_labels_only_assistant_tokens(tokenizers: dict) -> None:
    ids, mask = tokenize_chat(tokenizers["plain"], CHAT)
    ex = chat_example(ids, mask)
    assert ex["input_ids"].tolist() == ids[:-1]
    for j, label in enumerate(ex["labels"].tolist()):
        assert label == (ids[j + 1] if mask[j + 1] else IGNORE_INDEX)
    assert (ex["labels"] != IGNORE_INDEX).sum() == sum(mask[1:])


def test_masked_tokens_carry_no_loss_and_no_gradient(tokenizers: dict) -> None:
    ids, mask = tokenize_chat(tokenizers["plain"], CHAT)
    V = len(tokenizers["plain"])
    logits_TV = torch.randn(len(ids) - 1, V, generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss = F.cross_entropy(logits_TV, chat_example(ids, mask)["labels"])
    # plain reference: the mean over the positions whose next token is the assistant's
    ref = torch.stack([F.cross_entropy(logits_TV[j], torch.tensor(ids[j + 1]))
                       for j in range(len(ids) - 1) if mask[j + 1]]).mean()  # fmt: skip
    torch.testing.assert_close(loss, ref)
    loss.backward()
    user_rows = torch.tensor([not m for m in mask[1:]])
    assert user_rows.any() and torch.all(logits_TV.grad[user_rows] == 0)
    assert torch.all(logits_TV.grad[~user_rows].abs().sum(-1) > 0)
    # changing what a user position predicts does not change the loss; an assistant one does
    user_j = next(j for j in range(1, len(ids)) if not mask[j])
    assistant_j = next(j for j in range(1, len(ids)) if mask[j])
    for j, changes in ((user_j, False), (assistant_j, True)):
        other = list(ids)
        other[j] = (other[j] + 1) % V
        new = F.cross_entropy(logits_TV.detach(), chat_example(other, mask)["labels"])
        assert bool(new != loss.detach()) is changes


def test_user_positions_get_no_gradient_through_a_model(tokenizers: dict, tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 6)
    dm = TextDataModule(str(tokenizers["plain_dir"]), str(data), val_files=str(data), task="sft", seq_len=24,
                        batch_size=2)  # fmt: skip
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    check_packed_batch(batch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(dm.vocab_size, 16), torch.nn.Linear(16, dm.vocab_size))
    logits_BSV = model(batch["input_ids"])
    logits_BSV.retain_grad()
    F.cross_entropy(logits_BSV.flatten(0, 1), batch["labels"].flatten()).backward()
    masked = batch["labels"] == IGNORE_INDEX
    assert masked.any() and (~masked).any()
    assert torch.all(logits_BSV.grad[masked] == 0) and torch.all(logits_BSV.grad[~masked].abs().sum(-1) > 0)


def test_packed_sft_labels_are_the_assistant_tokens_of_each_chat(tokenizers: dict, tmp_path: Path) -> None:
    short = [{"role": "user", "content": "One two?"}, {"role": "assistant", "content": "Three."}]
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"messages": short}, {"messages": short}])
    dm = TextDataModule(str(tokenizers["plain_dir"]), str(data), val_files=str(data), task="sft", seq_len=64,
                        batch_size=1)  # fmt: skip
    dm.setup()
    rows = dm.train_dataset.rows
    check_packed_batch({k: v.long() for k, v in rows.items()})
    labelled = rows["labels"][rows["labels"] != IGNORE_INDEX].tolist()
    expect = []
    for chat in (CHAT, short, short):
        ids, mask = tokenize_chat(tokenizers["plain"], chat)
        expect += [i for i, m in zip(ids[1:], mask[1:]) if m]
    assert labelled == expect  # in order, no EOS labelled, nothing across chats


def test_chat_without_assistant_turn_names_file_and_line(tokenizers: dict, tmp_path: Path) -> None:
    rows = [{"messages": CHAT}, {"messages": CHAT}, {"messages": [{"role": "user", "content": "Hi"}]}]
    data = _write_jsonl(tmp_path / "chats.jsonl", rows)
    dm = TextDataModule(str(tokenizers["plain_dir"]), str(data), task="sft", seq_len=32, batch_size=1)
    with pytest.raises(ValueError, match=r"chats\.jsonl:3: the chat has no assistant turn"):
        dm.setup()


def test_malformed_messages_and_missing_field_are_refused(tokenizers: dict, tmp_path: Path) -> None:
    tok = tokenizers["plain"]
    with pytest.raises(ValueError, match="message 1 is"):
        tokenize_chat(tok, [{"role": "user", "content": "a"}, {"role": "assistant"}], "x.jsonl:4")
    with pytest.raises(ValueError, match="x.jsonl:4: messages is str"):
        tokenize_chat(tok, "hello", "x.jsonl:4")
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"conversation": CHAT}])
    dm = TextDataModule(str(tokenizers["plain_dir"]), str(data), task="sft", seq_len=32, batch_size=1)
    with pytest.raises(ValueError, match=r"chats\.jsonl:2 has no field 'messages' \(keys: \['conversation'\]\)"):
        dm.setup()
    dm = TextDataModule(str(tokenizers["plain_dir"]), str(data), task="sft", field="conversation", seq_len=32,
                        batch_size=1, max_documents=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"chats\.jsonl:1 has no field 'conversation'"):
        dm.setup()


def test_template_that_rewrites_earlier_turns_is_refused(tokenizers: dict, tmp_path: Path) -> None:
    tok = load_tokenizer(tokenizers["plain_dir"])
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>(earlier)<|end|>"
        "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ValueError, match=r"d\.jsonl:2: the chat template renders turn 2 differently.*generation"):
        tokenize_chat(tok, CHAT, "d.jsonl:2")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        tokenize_chat(tok, CHAT)
