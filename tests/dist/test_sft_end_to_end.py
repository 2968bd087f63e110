"""SFT end to end on 2 CPU ranks: an HF checkpoint in, fine-tuned, exported, loaded by transformers, sampled.

1. A random Qwen3-MoE checkpoint (transformers' own class, fp32, sharded safetensors with an index)
   and a tokenizer trained here, saved to one directory (``_tiny_hf_checkpoint.py``), and a jsonl
   file of chats.
2. ``lightning-moe fit --config configs/qwen3_30b_a3b_sft.yaml`` with overrides only: 2 ranks, EP2
   (``load_sharded``: each rank reads its own experts from the shards), fp32, 100 steps,
   ``TextDataModule`` SFT with packing, the recipe's callbacks. The validation loss before the
   first step equals the one computed here from transformers' ``from_pretrained`` of the same
   directory (so the sharded load read the checkpoint's weights), and falls.
3. Assistant-only loss, end to end: the trained model's loss on assistant tokens falls far below
   the untrained model's while its loss on the user turns' tokens, which carry no label, does not
   (``tests/unit/test_sft.py`` proves the labels of the packed rows themselves).
4. ``torchrun -m lightning_moe.export DCP OUT --streaming --ep 2`` writes HF safetensors, every rank
   its own files; ``AutoModelForCausalLM.from_pretrained(OUT)`` gives the logits of the trained
   model read from the DCP folder (``lightning_moe.generate.load_model``).
5. ``lightning-moe generate`` on the export and the tokenizer prints the greedy tokens that a
   plain argmax loop over transformers' model gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from _harness import ValidationLoss, run_cli_fit, run_torchrun_module, validation_loss
from _tiny_hf_checkpoint import QUESTIONS, save_tiny_checkpoint, tiny_run_overrides, write_chats

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

RECIPE = "qwen3_30b_a3b_sft.yaml"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS, WORLD, VAL_BATCHES = 100, 2, 2


@dataclass(frozen=True)
class Run:
    hf: Path  # the checkpoint fine-tuned, with its tokenizer
    chats: Path
    dcp: Path  # the run's last checkpoint (a DCP folder)
    export: Path  # its streaming export
    out: str  # the fit's output
    loss: ValidationLoss


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("sft")
    # weights 5x the usual scale: far from uniform predictions, so a misplaced expert changes the loss
    hf = save_tiny_checkpoint(tmp / "hf", "qwen3_moe", max_shard_size="40KB", initializer_range=0.1)
    assert len(list(hf.glob("model-*.safetensors"))) > 2 and (hf / "model.safetensors.index.json").is_file()
    chats = write_chats(tmp / "chats.jsonl", 256)
    args = [*tiny_run_overrides(hf, chats, STEPS), f"--trainer.strategy.init_args.ep={WORLD}"]
    out = run_cli_fit(RECIPE, args, tmp, timeout=300)
    dcp = tmp / "runs" / "qwen3_30b_a3b_sft" / "checkpoints" / "last.ckpt"
    export = tmp / "export"
    run_torchrun_module("lightning_moe.export", WORLD, [str(dcp), str(export), "--streaming", f"--ep={WORLD}"],
                        timeout=240, cwd=tmp)  # fmt: skip
    return Run(hf, chats, dcp, export, out, validation_loss(out))


def _datamodule(run: Run) -> Any:
    """The run's data module: the recipe's arguments with the overrides the run was given."""
    from lightning_moe.data import TextDataModule

    args = dict(yaml.safe_load((CONFIGS / RECIPE).read_text())["data"]["init_args"])
    for flag in tiny_run_overrides(run.hf, run.chats, STEPS):
        key, _, value = flag.removeprefix("--").partition("=")
        if key.startswith("data.init_args."):
            args[key.removeprefix("data.init_args.")] = yaml.safe_load(value)
    dm = TextDataModule(**args)
    dm.setup("fit")
    return dm


def _rank0_val_loss(model: Any, rows: dict[str, torch.Tensor], batch_size: int) -> float:
    """Rank 0's validation loss as the run logs it: its batches of the unshuffled DistributedSampler,
    each the token sum on its rows over the labelled tokens of both ranks' batches, times 2."""
    n = len(rows["input_ids"])
    order = list(range(n)) + list(range(n))[: -n % WORLD or 0]
    losses = []
    for b in range(VAL_BATCHES):
        parts = [order[rank::WORLD][b * batch_size : (b + 1) * batch_size] for rank in range(WORLD)]
        labels = [rows["labels"][p] for p in parts]
        labelled = sum(int((lab != -100).sum()) for lab in labels)
        batch = {k: v[parts[0]] for k, v in rows.items()}
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        total = F.cross_entropy(logits.flatten(0, 1), labels[0].flatten(), ignore_index=-100, reduction="sum")
        losses.append(float(total) * WORLD / labelled)
    return sum(losses) / len(losses)


def _assistant_and_user_losses(model: Any, rows: dict[str, torch.Tensor], tokenizer: Any) -> tuple[float, float]:
    """Mean loss on the labelled (assistant) targets, and on the user turns' tokens (found from the markers)."""
    user_id = tokenizer.convert_tokens_to_ids("<|user|>")
    others = set(tokenizer.convert_tokens_to_ids(["<|system|>", "<|assistant|>", "<|end|>", tokenizer.eos_token]))
    logits = model(rows["input_ids"], rows["position_ids"], rows["document_ids"])
    ids, labels = rows["input_ids"], rows["labels"]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(ids[:, 1:])
    in_user = torch.zeros_like(ids, dtype=torch.bool)  # from a <|user|> marker up to the next marker
    for r, row in enumerate(ids.tolist()):
        inside = False
        for j, token in enumerate(row):
            inside = token == user_id or (inside and token not in others)
            in_user[r, j] = inside
    assistant, user = labels[:, :-1] != -100, in_user[:, :-1] & in_user[:, 1:]
    assert int(user.sum()) > 50 and int(assistant.sum()) > 50
    return float(nll[assistant].mean()), float(nll[user].mean())


def _lit(pretrained: Path) -> Any:
    from lightning_moe.lit_hf import HFMoELanguageModel

    moe = yaml.safe_load((CONFIGS / RECIPE).read_text())["model"]["init_args"]["moe"]
    return HFMoELanguageModel(pretrained=str(pretrained), moe=moe).eval()  # transformers' from_pretrained


def test_fit_loads_the_checkpoint_sharded_and_lowers_the_validation_loss(run: Run) -> None:
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached." in run.out, run.out[-3000:]
    dm = _datamodule(run)
    with torch.no_grad():
        rows = {k: v.long() for k, v in dm.val_dataset.rows.items()}
        expected = _rank0_val_loss(_lit(run.hf), rows, dm.batch_size)
    assert run.loss.first_step == 0 and abs(run.loss.first - expected) < 2e-4, (run.loss, expected)
    assert run.loss.last_step == STEPS and run.loss.last < 0.5 * run.loss.first, run.loss


def test_only_assistant_tokens_were_trained(run: Run) -> None:
    from lightning_moe.generate import load_model

    dm = _datamodule(run)
    rows = {k: v.long() for k, v in dm.val_dataset.rows.items()}
    with torch.no_grad():
        before = _assistant_and_user_losses(_lit(run.hf), rows, dm.tokenizer)
        after = _assistant_and_user_losses(load_model(run.dcp).module, rows, dm.tokenizer)
    assert after[0] < 0.3 * before[0], (before, after)
    assert after[1] > 0.8 * before[1], (before, after)


def test_streaming_export_loads_in_transformers_with_the_trained_logits(run: Run) -> None:
    from lightning_moe.generate import load_model

    index = json.loads((run.export / "model.safetensors.index.json").read_text())
    assert {Path(f).name.split("-")[1] for f in index["weight_map"].values()} == {"rank00000", "rank00001"}
    exported = transformers.AutoModelForCausalLM.from_pretrained(run.export, local_files_only=True).eval()
    trained = load_model(run.dcp).module
    ids = torch.randint(0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = exported(input_ids=ids).logits
        torch.testing.assert_close(got, trained(ids), rtol=1e-5, atol=1e-5)
        original = transformers.AutoModelForCausalLM.from_pretrained(run.hf, local_files_only=True)
        assert not torch.allclose(got, original(input_ids=ids).logits, atol=1e-2)  # trained, not the input


def test_generate_prints_the_greedy_tokens_of_the_export(run: Run, capsys: pytest.CaptureFixture) -> None:
    from lightning_moe.cli import main as cli_main

    question = QUESTIONS[0][0]
    cli_main(["generate", "--checkpoint", str(run.export), "--tokenizer", str(run.hf), "--prompt", question,
              "--chat", "--greedy", "--max_new_tokens", "8", "--show_ids"])  # fmt: skip
    text, shown = capsys.readouterr().out.splitlines()[-2:]
    tok = transformers.AutoTokenizer.from_pretrained(run.hf, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(run.export, local_files_only=True).eval()
    rendered = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    context = list(tok(rendered, add_special_tokens=False)["input_ids"])
    new: list[int] = []
    with torch.no_grad():
        while len(new) < 8 and (not new or new[-1] != tok.eos_token_id):
            new.append(int(model(input_ids=torch.tensor([context + new])).logits[0, -1].argmax()))
    assert shown == "ids: " + " ".join(map(str, new)) and new
    assert text.endswith(tok.decode(new)), text
