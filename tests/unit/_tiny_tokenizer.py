"""A tiny BPE tokenizer with a chat template, trained in a second for tests.

``make_tiny_tokenizer(folder)`` trains a byte-level BPE (``tokenizers``) on a few KB of text,
wraps it as ``PreTrainedTokenizerFast`` with the special tokens below and a chat template, and
saves it with ``save_pretrained(folder)``; ``AutoTokenizer.from_pretrained(folder,
local_files_only=True)`` loads it back. ``generation=True`` marks the assistant turns with
``{% generation %}`` (so ``return_assistant_tokens_mask`` works); ``False`` leaves it out.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TRAINING_TEXT", "make_tiny_tokenizer"]

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

_TURN = "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{GEN_OPEN}{{ message['content'] + '<|end|>' }}{GEN_CLOSE}"
    "{% else %}" + _TURN + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes each token to a few experts. "
    "Hello, how are you today? I am fine, thank you. What is the capital of France? Paris is the capital. "
    "Tokens, experts, routers and gates: the model learns which expert fits each token best. "
    "One two three four five six seven eight nine ten. Numbers 0123456789 and symbols !?.,;:()[]{}. "
) * 8


def make_tiny_tokenizer(folder: str | Path, generation: bool = False, vocab_size: int = 400) -> Path:
    """Train, wrap and save the tiny tokenizer in ``folder``; returns ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    template = CHAT_TEMPLATE.replace("{GEN_OPEN}", "{% generation %}" if generation else "")
    template = template.replace("{GEN_CLOSE}", "{% endgeneration %}" if generation else "")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder
