"""Tokenizers from local checkpoint directories (never the hub), and the ids the data needs from them.

:func:`load_tokenizer` is ``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` after
checking that ``folder`` holds tokenizer files, so a wrong path fails with one line naming it
instead of a hub lookup error. :func:`eos_token_id` is the id that ends each document in packed
rows; :func:`encode_text` tokenizes one plain-text document the tokenizer's own way (with the
special tokens it adds, e.g. a BOS). :func:`train_bpe_tokenizer` trains a small byte-level BPE
tokenizer with a chat template on given texts, for trials and tests without a downloaded checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CHAT_SPECIAL_TOKENS", "TOKENIZER_FILES", "encode_text", "eos_token_id", "load_tokenizer"]
__all__ += ["train_bpe_tokenizer"]

# Any one of these marks a folder save_pretrained wrote a tokenizer to.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(folder: str | Path, owner: str = "load_tokenizer") -> Any:
    """The tokenizer saved in ``folder`` (local files only).

    Raises ``ValueError`` when ``folder`` is not a directory, holds none of
    :data:`TOKENIZER_FILES`, or transformers cannot load what it holds.
    """
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"{owner}: tokenizer_dir={folder!r} is a {type(folder).__name__}; pass a folder path.")
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{owner}: tokenizer_dir={str(path)!r} is not a directory; pass the folder a tokenizer "
                         "was saved to (save_pretrained), e.g. the model's checkpoint directory.")  # fmt: skip
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{owner}: tokenizer_dir={str(path)!r} holds no tokenizer (none of "
                         f"{list(TOKENIZER_FILES)}); save one there with tokenizer.save_pretrained(dir).")  # fmt: skip
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{owner}: tokenizer_dir={str(path)!r} could not be loaded ({first}); "
                         "re-save the tokenizer with save_pretrained.") from exc  # fmt: skip


def eos_token_id(tokenizer: Any, owner: str = "eos_token_id") -> int:
    """The tokenizer's EOS id; ``ValueError`` when it has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise ValueError(f"{owner}: the tokenizer has no eos_token (eos_token_id={eos!r}); set one "
                         "(tokenizer.eos_token = '...') and save it again: packing puts it between "
                         "documents.")  # fmt: skip
    return eos


def encode_text(tokenizer: Any, text: str, where: str = "") -> list[int]:
    """Token ids of one plain-text document (the tokenizer's special tokens included)."""
    if not isinstance(text, str):
        at = f"{where}: " if where else ""
        raise ValueError(f"encode_text: {at}the document is a {type(text).__name__}, not a str; "
                         "point the field name at a text field.")  # fmt: skip
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# The special tokens of train_bpe_tokenizer, ids 0 to 5 in this order: padding, end of document,
# one tag per chat role, end of turn.
CHAT_SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{GEN_OPEN}{{ message['content'] + '<|end|>' }}{GEN_CLOSE}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512, generation: bool = True) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, as a transformers ``PreTrainedTokenizerFast``.

    Its first ids are :data:`CHAT_SPECIAL_TOKENS` (``<|pad|>`` pads, ``<|endoftext|>`` is the EOS),
    then the 256 byte symbols, then merges up to ``vocab_size`` entries, so any text encodes. Its
    chat template writes each turn as ``<|role|>content<|end|>`` and, with
    ``add_generation_prompt``, ends on ``<|assistant|>``; ``generation=True`` wraps the assistant
    turns in ``{% generation %}`` so ``return_assistant_tokens_mask`` (SFT's assistant-only loss)
    works. Needs ``tokenizers`` and ``transformers`` (``pip install 'lightning-moe[hf]'``). Save it
    with ``save_pretrained(folder)``; :func:`load_tokenizer` reads it back.
    """
    smallest = len(CHAT_SPECIAL_TOKENS) + 256
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(f"train_bpe_tokenizer: vocab_size={vocab_size!r} must be an int >= {smallest} "
                         "(the special tokens and the 256 byte symbols).")  # fmt: skip
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ImportError("train_bpe_tokenizer needs the tokenizers and transformers packages: "
                          f"pip install 'lightning-moe[hf]' ({exc}).") from exc  # fmt: skip
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=CHAT_SPECIAL_TOKENS[0],
                                        eos_token=CHAT_SPECIAL_TOKENS[1],
                                        additional_special_tokens=list(CHAT_SPECIAL_TOKENS[2:]))  # fmt: skip
    template = _CHAT_TEMPLATE.replace("{GEN_OPEN}", "{% generation %}" if generation else "")
    tokenizer.chat_template = template.replace("{GEN_CLOSE}", "{% endgeneration %}" if generation else "")
    return tokenizer
