"""Tiny random Hugging Face MoE checkpoints of the full-size recipes' families, with a tokenizer.

``save_tiny_checkpoint(folder, family)`` writes what a downloaded checkpoint directory holds:
``config.json``, sharded safetensors (``save_pretrained(max_shard_size=...)``: several shards and an
index) and the tokenizer of ``tests/unit/_tiny_tokenizer.py`` (trained here, with a chat template).
``write_chats(path, n)`` writes a jsonl file of ``{"messages": [...]}`` chats whose assistant replies
follow from the question, so a fine-tune lowers the validation loss within 100 steps.
``tiny_run_overrides`` are the command-line overrides that run a full-size SFT recipe of
:data:`FULL_SIZE_RECIPES` on such a checkpoint on 2 CPU ranks (its callbacks kept; a recipe's own overrides
in :data:`FULL_SIZE_RECIPES` may ask for more ranks). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from _tiny_tokenizer import make_tiny_tokenizer  # noqa: E402  (tests/unit/_tiny_tokenizer.py)

__all__ = ["FAMILIES", "FULL_SIZE_RECIPES", "QUESTIONS", "save_tiny_checkpoint", "tiny_run_overrides", "write_chats"]

_ATTENTION = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# model_type -> config of a 2-layer model with the family's MoE block and attention (MLA for DeepSeek-V2)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(_ATTENTION, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "deepseek_v2": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                        first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy", q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "mixtral": dict(_ATTENTION, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    # max_position_embeddings as released: its YaRN factor 32 is relative to 4096 positions
    "gpt_oss": dict(_ATTENTION, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                    max_position_embeddings=131072),
}  # fmt: skip

QUESTIONS = [
    ("What is the capital of France?", "Paris is the capital."),
    ("How are you today?", "I am fine, thank you."),
    ("Count from one to five.", "One two three four five."),
    ("Which animal jumps over the dog?", "The quick brown fox."),
    ("What does a router do?", "It routes each token to a few experts."),
    ("Name some symbols.", "Symbols !?.,;:()[]{}."),
    ("Count from six to ten.", "Six seven eight nine ten."),
    ("What does the model learn?", "Which expert fits each token best."),
]


def save_tiny_checkpoint(
    folder: Path, family: str, max_shard_size: str = "40KB", seed: int = 0, initializer_range: float = 0.02
) -> Path:
    """A random ``family`` model (fp32, untied embeddings, weights drawn with std ``initializer_range``)
    and the tiny tokenizer, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    make_tiny_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    common = dict(vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=128, tie_word_embeddings=False,
                  bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=initializer_range)
    config = AutoConfig.for_model(family, **{**common, **FAMILIES[family]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def write_chats(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` chats, one a line: a question of :data:`QUESTIONS` and its fixed reply."""
    draw = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            question, reply = draw.choice(QUESTIONS)
            chat = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


# full-size recipe -> (family of its tiny checkpoint, overrides that cut its layout to 2 ranks, or 4)
FULL_SIZE_RECIPES: dict[str, tuple[str, list[str]]] = {
    "qwen3_30b_a3b_sft.yaml": ("qwen3_moe", ["--trainer.strategy.init_args.ep=2"]),
    "deepseek_v2_lite_sft.yaml": ("deepseek_v2", ["--trainer.strategy.init_args.ep=2"]),
    "mixtral_8x7b_sft.yaml": ("mixtral", ["--trainer.strategy.init_args.ep=2"]),
    "gpt_oss_20b_sft.yaml": ("gpt_oss", ["--trainer.strategy.init_args.ep=2"]),
    # TP2 x CP2 with sequence parallel keeps its attention layout: 4 ranks, experts EP2 x EDP2
    "hf_qwen3_moe_long_context.yaml": ("qwen3_moe", ["--trainer.devices=4", "--trainer.strategy.init_args.ep=2"]),
}


def tiny_run_overrides(checkpoint: Path, chats: Path, steps: int) -> list[str]:
    """A full-size SFT recipe on 2 CPU ranks in fp32 for ``steps`` steps: the tiny checkpoint, its
    tokenizer and ``chats``, rows of 32 tokens, one micro-batch a step, a learning rate for a random model."""
    return [
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.precision=32",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps // 2}", "--trainer.limit_val_batches=2",
        "--trainer.accumulate_grad_batches=1", "--trainer.enable_progress_bar=false",
        f"--model.init_args.pretrained={checkpoint}", "--model.init_args.optimizer.learning_rate=3e-3",
        "--model.init_args.optimizer.warmup_steps=10",
        f"--data.init_args.tokenizer_dir={checkpoint}", f"--data.init_args.train_files={chats}",
        "--data.init_args.val_fraction=0.1", "--data.init_args.seq_len=32", "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0",
    ]  # fmt: skip
