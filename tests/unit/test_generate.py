"""Generation: greedy equals the argmax of a manual forward loop, temperature 0 is greedy, top-p keeps the
smallest set with mass >= p, byte-level models generate without a tokenizer, checkpoints and HF folders load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _tiny_tokenizer import make_tiny_tokenizer
from lightning_moe.cli import main as cli_main
from lightning_moe.config import MoEConfig
from lightning_moe.generate import generate_ids, load_model, main, sample_next, top_p_probs
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig


def _config(vocab: int, max_seq_len: int = 64) -> TransformerConfig:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=32, num_experts=4, top_k=2, experts_backend="torch")
    return TransformerConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=2, moe=moe,
                             max_seq_len=max_seq_len)  # fmt: skip


def _checkpoint(
    tmp_path: Path, vocab: int, max_seq_len: int = 64, name: str = "m.ckpt"
) -> tuple[Path, MoELanguageModel]:
    """A Lightning checkpoint file of a random MoELanguageModel, written the way the Trainer writes one."""
    torch.manual_seed(0)
    lit = MoELanguageModel(_config(vocab, max_seq_len))
    ckpt = {"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams)}
    lit.on_save_checkpoint(ckpt)  # config dataclasses become plain dicts
    path = tmp_path / name
    torch.save(ckpt, path)
    return path, lit.eval()


@torch.no_grad()
def _manual_greedy(model: torch.nn.Module, prompt: list[int], n: int, window: int | None = None) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ctx = ids if window is None else ids[-window:]
        ids.append(int(model(torch.tensor([ctx]))[0, -1].argmax()))
    return ids[len(prompt) :]


# --- sampling ------------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_with_enough_mass() -> None:
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])  # sorted: 0.5 (id 1), 0.25 (id 3), 0.125, 0.125
    for p, kept in ((1e-6, {1}), (0.5, {1}), (0.6, {1, 3}), (0.75, {1, 3}), (0.8, {0, 1, 3}), (1.0, {0, 1, 2, 3})):
        out = top_p_probs(probs, p)
        assert {i for i in range(4) if out[i] > 0} == kept, p
        torch.testing.assert_close(out.sum(), torch.tensor(1.0))
        torch.testing.assert_close(out[sorted(kept)], probs[sorted(kept)] / probs[sorted(kept)].sum())
    with pytest.raises(ValueError, match="top_p=0"):
        top_p_probs(probs, 0)


def test_sampling_draws_only_from_the_nucleus_in_proportion() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.05, 0.3, 0.1]))
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_next(logits, 1.0, 0.75, g) for _ in range(500)])
    counts = torch.bincount(draws, minlength=5)
    assert counts[[0, 2, 4]].sum() == 0 and counts[[1, 3]].min() > 0  # 0.5 + 0.3 reach 0.75
    # 0.5 + 0.3 = 0.8 < 0.85: the 0.1 joins, and with it the set reaches 0.85
    counts = torch.bincount(torch.tensor([sample_next(logits, 1.0, 0.85, g) for _ in range(2000)]), minlength=5)
    assert counts[[0, 2]].sum() == 0 and counts[4] > 0
    share = counts.float() / counts.sum()
    torch.testing.assert_close(share[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.1]) / 0.9, atol=0.04, rtol=0)
    assert sample_next(logits, 0.0) == 1
    for bad, match in (({"temperature": -1.0}, "temperature=-1.0"), ({"top_p": 1.5}, "top_p=1.5")):
        with pytest.raises(ValueError, match=match):
            sample_next(logits, **bad)


# --- generation ----------------------------------------------------------------------------------


def test_greedy_equals_a_manual_argmax_loop_and_temperature_zero(tmp_path: Path) -> None:
    path, lit = _checkpoint(tmp_path, 256)
    loaded = load_model(path)
    prompt = list(b"def f(x):")
    greedy = generate_ids(loaded.forward, prompt, 12, greedy=True)
    assert greedy == _manual_greedy(lit.model, prompt, 12)
    assert generate_ids(loaded.forward, prompt, 12, temperature=0.0) == greedy
    assert generate_ids(loaded.forward, prompt, 12, top_p=1e-6, seed=5) == greedy  # only the argmax is left
    sampled = generate_ids(loaded.forward, prompt, 12, temperature=1.5, seed=1)
    assert sampled == generate_ids(loaded.forward, prompt, 12, temperature=1.5, seed=1) and sampled != greedy
    assert generate_ids(loaded.forward, prompt, 0) == []
    eos = greedy[3]
    stopped = generate_ids(loaded.forward, prompt, 12, greedy=True, eos_id=eos)
    assert stopped == greedy[: greedy.index(eos) + 1]


def test_context_is_cut_to_max_seq_len(tmp_path: Path) -> None:
    path, lit = _checkpoint(tmp_path, 256, max_seq_len=8)
    loaded = load_model(path)
    prompt = list(b"a longer prompt")
    assert loaded.max_context == 8
    new = generate_ids(loaded.forward, prompt, 6, greedy=True, max_context=loaded.max_context)
    assert new == _manual_greedy(lit.model, prompt, 6, window=8)


def test_byte_model_generates_from_bytes_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, lit = _checkpoint(tmp_path, 256)
    cli_main(["generate", "--checkpoint", str(path), "--prompt", "hello", "--max_new_tokens", "6", "--greedy",
              "--show_ids"])  # fmt: skip
    text, ids = capsys.readouterr().out.splitlines()[-2:]
    expected = _manual_greedy(lit.model, list(b"hello"), 6)
    assert ids == "ids: " + " ".join(map(str, expected))
    assert text.startswith("hello")


def test_tokenizer_model_from_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    from lightning_moe.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    path, lit = _checkpoint(tmp_path, len(tok))
    main(["--checkpoint", str(path), "--tokenizer", str(tok_dir), "--prompt", "The quick brown", "--greedy",
          "--max_new_tokens", "5", "--show_ids"])  # fmt: skip
    text, ids = capsys.readouterr().out.splitlines()[-2:]
    prompt = tok("The quick brown")["input_ids"]
    expected = _manual_greedy(lit.model, prompt, 5)
    expected = expected[: expected.index(tok.eos_token_id) + 1] if tok.eos_token_id in expected else expected
    assert ids == "ids: " + " ".join(map(str, expected))
    assert text == "The quick brown" + tok.decode(expected)


def test_hf_directory_with_its_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    transformers = pytest.importorskip("transformers")
    tok_dir = make_tiny_tokenizer(tmp_path / "hf")
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=400, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tok_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    prompt = tok("Hello, how")["input_ids"]

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    expected = generate_ids(forward, prompt, 4, greedy=True, eos_id=tok.eos_token_id)
    assert expected == _manual_greedy(lambda ids: forward(ids), prompt, len(expected))
    main(["--checkpoint", str(tok_dir), "--prompt", "Hello, how", "--greedy", "--max_new_tokens", "4", "--show_ids"])
    assert capsys.readouterr().out.splitlines()[-1] == "ids: " + " ".join(map(str, expected))
    swapped = load_model(tok_dir, swap_moe=True)
    from lightning_moe.moe.utils import find_moe_layers

    assert len(find_moe_layers(swapped.module)) == 2
    main(["--checkpoint", str(tok_dir), "--prompt", "Hello, how", "--greedy", "--max_new_tokens", "4", "--show_ids",
          "--swap_moe"])  # fmt: skip
    want = generate_ids(swapped.forward, prompt, 4, greedy=True, eos_id=tok.eos_token_id)
    assert capsys.readouterr().out.splitlines()[-1] == "ids: " + " ".join(map(str, want))


def test_bad_input_exits_with_one_line(tmp_path: Path) -> None:
    byte_ckpt, _ = _checkpoint(tmp_path, 256, name="bytes.ckpt")
    big_ckpt, _ = _checkpoint(tmp_path, 512, name="big.ckpt")
    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    cases = (
        (["--checkpoint", str(tmp_path / "nope.ckpt")], "does not exist"),
        (["--checkpoint", str(byte_ckpt), "--top_p", "0"], "top_p=0.0"),
        (["--checkpoint", str(byte_ckpt), "--temperature", "-1"], "temperature=-1.0"),
        (["--checkpoint", str(big_ckpt)], "vocab_size=512 .*pass --tokenizer"),
        (["--checkpoint", str(byte_ckpt), "--tokenizer", str(tok_dir)], "has 400 tokens but the model's vocab_size"),
        (["--checkpoint", str(byte_ckpt), "--tokenizer", str(tmp_path)], "holds no tokenizer"),
        (["--checkpoint", str(byte_ckpt), "--swap_moe"], "--swap_moe applies to HF model directories"),
        (["--checkpoint", str(byte_ckpt), "--max_new_tokens", "-2"], "max_new_tokens=-2"),
    )
    for args, match in cases:
        with pytest.raises(SystemExit, match=match):
            main([*args, "--prompt", "x"])
    with pytest.raises(SystemExit, match="the prompt is empty"):
        main(["--checkpoint", str(byte_ckpt), "--prompt", ""])


def test_sft_fit_on_the_command_line_then_generate_the_learned_reply(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``lightning-moe fit`` with TextDataModule(task="sft") memorizes one chat; ``generate --chat`` replays it."""
    import json

    import yaml

    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital."}]  # fmt: skip
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(32)))
    moe = {"hidden_size": 32, "ffn_hidden_size": 32, "num_experts": 4, "top_k": 2, "experts_backend": "torch"}
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 40, "logger": False, "enable_progress_bar": False,
            "enable_model_summary": False, "default_root_dir": str(tmp_path / "run"), "num_sanity_val_steps": 0,
            "val_check_interval": 40, "check_val_every_n_epoch": None, "limit_val_batches": 1,
        },
        "model": {"class_path": "lightning_moe.lit.MoELanguageModel", "init_args": {
            "model": {"vocab_size": 400, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 64,
                      "moe": moe},
            "learning_rate": 0.01, "warmup_steps": 2}},
        "data": {"class_path": "lightning_moe.data.text_datamodule.TextDataModule", "init_args": {
            "tokenizer_dir": str(tok_dir), "train_files": str(data), "val_files": str(data), "task": "sft",
            "seq_len": 32, "batch_size": 4}},
    }  # fmt: skip
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    cli_main(["fit", "--config", str(tmp_path / "sft.yaml")])
    (ckpt,) = sorted((tmp_path / "run").rglob("*.ckpt"))
    capsys.readouterr()
    cli_main(["generate", "--checkpoint", str(ckpt), "--tokenizer", str(tok_dir), "--prompt", chat[0]["content"],
              "--chat", "--stop", "<|end|>", "--greedy", "--max_new_tokens", "16"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()[-1]
    assert out == "<|user|>What is the capital of France?<|end|><|assistant|>Paris is the capital.<|end|>"


def test_hf_lightning_checkpoint_rebuilds_the_swapped_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from lightning_moe.lit_hf import HFMoELanguageModel

    hf_config = {
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 32,
    }  # fmt: skip
    torch.manual_seed(0)
    lit = HFMoELanguageModel(hf_config=hf_config, moe={"experts_backend": "torch"}).eval()
    ckpt = {"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams)}
    lit.on_save_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "hf.ckpt")
    loaded = load_model(tmp_path / "hf.ckpt")
    assert loaded.vocab_size == 64 and loaded.max_context == 32
    prompt = [3, 1, 4, 1, 5]
    assert generate_ids(loaded.forward, prompt, 6, greedy=True) == _manual_greedy(lit, prompt, 6)
