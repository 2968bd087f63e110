"""A tiny BPE tokenizer with a chat template, trained in a second for tests.

``make_tiny_tokenizer(folder)`` trains the byte-level BPE tokenizer of
``lightning_moe.data.tokenizer.train_bpe_tokenizer`` on a few KB of text (special tokens
:data:`SPECIAL_TOKENS`, a chat template) and saves it with ``save_pretrained(folder)``;
``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` loads it back. ``generation=True``
marks the assistant turns with ``{% generation %}`` (so ``return_assistant_tokens_mask`` works);
``False`` leaves it out.
"""

from __future__ import annotations

from pathlib import Path

from lightning_moe.data.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer

__all__ = ["SPECIAL_TOKENS", "TRAINING_TEXT", "make_tiny_tokenizer"]

SPECIAL_TOKENS = list(CHAT_SPECIAL_TOKENS)

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes each token to a few experts. "
    "Hello, how are you today? I am fine, thank you. What is the capital of France? Paris is the capital. "
    "Tokens, experts, routers and gates: the model learns which expert fits each token best. "
    "One two three four five six seven eight nine ten. Numbers 0123456789 and symbols !?.,;:()[]{}. "
) * 8


def make_tiny_tokenizer(folder: str | Path, generation: bool = False, vocab_size: int = 400) -> Path:
    """Train, wrap and save the tiny tokenizer in ``folder``; returns ``folder``."""
    folder = Path(folder)
    train_bpe_tokenizer([TRAINING_TEXT], vocab_size=vocab_size, generation=generation).save_pretrained(folder)
    return folder
