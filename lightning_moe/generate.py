"""Sample text from a trained model: ``lightning-moe generate``, for checking what a run learned.

Legend: S tokens of the context, V vocabulary.

``lightning-moe generate --checkpoint CKPT --tokenizer DIR --prompt "..." [--max_new_tokens N]
[--temperature T] [--top_p P] [--greedy] [--chat] [--stop TEXT ...] [--seed S] [--device cpu]
[--swap_moe] [--show_ids]``

``--checkpoint`` is one of:

* a Lightning ``.ckpt`` file or a distributed (DCP) checkpoint directory of
  :class:`~lightning_moe.lit.MoELanguageModel` (the :class:`MoETransformer` is rebuilt from the
  checkpoint's hyper-parameters) or of :class:`~lightning_moe.lit_hf.HFMoELanguageModel` (rebuilt
  from its ``hf_config``/``pretrained``, MoE blocks swapped as in training); read with
  :func:`lightning_moe.export.load_checkpoint`;
* an HF directory (``config.json`` + weights): ``AutoModelForCausalLM``, local files only;
  ``--swap_moe`` swaps its MoE blocks for lightning-moe's layers (same weights and routing).

``--tokenizer`` is a folder with a saved tokenizer; without it, an HF directory's own tokenizer is
used when it holds one, and a model of at most 256 tokens (the byte-level recipes) reads the prompt
as UTF-8 bytes and writes bytes back. Generation stops after ``max_new_tokens``, at the
tokenizer's EOS, or at a ``--stop`` token (a token of the tokenizer, e.g. a chat template's
end-of-turn marker). ``--chat`` renders the prompt as one user turn with the tokenizer's chat
template and its generation prompt, as an SFT model saw its training chats.

There is no KV cache: every step runs the whole context (prompt and tokens so far, cut to the
model's longest sequence) through the model again, S forward passes of growing length for S new
tokens. That is slow for long outputs but exact and simple, which is what checking a run needs.

Sampling (:func:`sample_next`): ``--greedy`` or ``--temperature 0`` take the argmax; otherwise the
logits are divided by the temperature, and ``--top_p`` keeps the smallest set of most likely tokens
whose probability adds up to at least ``p`` (nucleus sampling) before drawing from a
``torch.Generator`` seeded ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LoadedModel",
    "generate_ids",
    "load_model",
    "main",
    "sample_next",
    "top_p_probs",
]

BYTE_VOCAB = 256


def top_p_probs(probs_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs_V`` restricted to the smallest set of most likely tokens with mass >= ``top_p``, renormalized.

    Ties at the edge of the set are broken by token id (the lower id is kept first).
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p_probs: top_p={top_p} must be in (0, 1]; use 1.0 to keep every token.")
    if top_p >= 1.0:
        return probs_V / probs_V.sum()
    order_V = torch.sort(probs_V, descending=True, stable=True).indices
    sorted_V = probs_V[order_V]
    before_V = torch.cumsum(sorted_V, 0) - sorted_V  # mass of the more likely tokens
    keep_sorted_V = before_V < top_p  # a token joins while the set is still short of p
    keep_V = torch.zeros_like(keep_sorted_V)
    keep_V[order_V] = keep_sorted_V
    kept_V = torch.where(keep_V, probs_V, 0.0)
    return kept_V / kept_V.sum()


def _check_sampling(temperature: float, top_p: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0.0:
        raise ValueError(f"generate: temperature={temperature!r} must be a number >= 0; 0 is greedy.")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p={top_p!r} must be in (0, 1]; use 1.0 to keep every token.")


def sample_next(
    logits_V: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """The next token id from one position's logits ``[V]`` (module doc). ``temperature=0``: argmax."""
    _check_sampling(temperature, top_p)
    logits_V = logits_V.detach().float().cpu()
    if temperature == 0.0:
        return int(torch.argmax(logits_V))
    probs_V = top_p_probs(torch.softmax(logits_V / temperature, dim=-1), top_p)
    return int(torch.multinomial(probs_V, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    forward: Callable[[torch.Tensor], torch.Tensor],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    eos_id: int | Sequence[int] | None = None,
    seed: int = 0,
    max_context: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The new token ids after ``prompt_ids`` (at most ``max_new_tokens``; stops after ``eos_id``, an id or
    several).

    ``forward`` maps ids ``[1, S]`` to logits ``[1, S, V]``; each step runs it on the whole context,
    its last ``max_context`` tokens when given (no KV cache). ``greedy`` is ``temperature=0``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 0.")
    _check_sampling(temperature, top_p)
    context = [int(t) for t in prompt_ids]
    if not context:
        raise ValueError("generate: the prompt is empty; give at least one token (a non-empty --prompt).")
    generator = torch.Generator().manual_seed(seed)
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else {int(i) for i in eos_id}
    temperature = 0.0 if greedy else temperature
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = context if max_context is None else context[-max_context:]
        ids_1S = torch.tensor([window], dtype=torch.int64, device=device)
        logits_1SV = forward(ids_1S)
        token = sample_next(logits_1SV[0, -1], temperature, top_p, generator)
        new.append(token)
        context.append(token)
        if token in stop:
            break
    return new


@dataclass
class LoadedModel:
    """A model ready to sample from: ``forward(ids[1, S]) -> logits[1, S, V]`` and its limits."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    max_context: int | None
    module: torch.nn.Module
    tokenizer_dir: str | None = None  # an HF directory that also holds a tokenizer


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _load_hf_dir(path: Path, swap_moe: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    from lightning_moe.data.tokenizer import TOKENIZER_FILES

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    if swap_moe:
        from lightning_moe.models.hf import swap_moe_blocks

        swap_moe_blocks(model)
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    return LoadedModel(
        forward=lambda ids: model(input_ids=ids, use_cache=False).logits,
        vocab_size=int(model.config.vocab_size),
        max_context=getattr(model.config, "max_position_embeddings", None),
        module=model,
        tokenizer_dir=str(path) if has_tokenizer else None,
    )


def _load_lightning(path: Path) -> LoadedModel:
    from lightning_moe.export import load_checkpoint, strip_prefix
    from lightning_moe.models.transformer import MoETransformer, TransformerConfig

    state, hparams = load_checkpoint(path)
    # LightningCLI adds "_class_path"/"_instantiator" and stores the config given in YAML as a plain dict.
    hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}
    config = hparams.get("model")
    if isinstance(config, dict) and {"vocab_size", "moe"} <= config.keys():
        config = TransformerConfig(**config)
    if isinstance(config, TransformerConfig):
        model = MoETransformer(config)
        model.load_state_dict(strip_prefix(state, "model."))
        return LoadedModel(forward=model, vocab_size=config.vocab_size, max_context=config.max_seq_len, module=model)
    if hparams.get("hf_config") is not None or hparams.get("pretrained") is not None:
        from lightning_moe.lit_hf import HFMoELanguageModel

        lit = HFMoELanguageModel(**hparams)
        if any(p.is_meta for p in lit.parameters()):  # load_sharded: a skeleton that the checkpoint fills
            from lightning_moe.checkpoint.hf_sharded import reset_nonpersistent_buffers

            lit.to_empty(device="cpu")
            reset_nonpersistent_buffers(lit.model)
        lit.load_state_dict(state)
        cfg = lit.model.config
        return LoadedModel(
            forward=lit, vocab_size=int(cfg.vocab_size), max_context=getattr(cfg, "max_position_embeddings", None),
            module=lit,
        )  # fmt: skip
    raise ValueError(
        f"generate: checkpoint={str(path)!r} has hyper-parameters {sorted(hparams)}, neither a MoELanguageModel's "
        "(model: TransformerConfig) nor an HFMoELanguageModel's (hf_config / pretrained); pass a checkpoint "
        "written by lightning-moe fit, or an HF model directory."
    )


def load_model(checkpoint: str | Path, swap_moe: bool = False, device: str = "cpu") -> LoadedModel:
    """The model of ``checkpoint`` (module doc), in eval mode on ``device``."""
    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"generate: checkpoint={str(path)!r} does not exist; pass a .ckpt file, a DCP "
                         "checkpoint directory or an HF model directory.")  # fmt: skip
    if _is_hf_dir(path):
        loaded = _load_hf_dir(path, swap_moe)
    else:
        if swap_moe:
            raise ValueError("generate: --swap_moe applies to HF model directories; a lightning-moe checkpoint "
                             "already holds its own MoE layers, drop the flag.")  # fmt: skip
        loaded = _load_lightning(path)
    loaded.module.to(device).eval()
    return loaded


class _ByteCodec:
    """Prompt and output as UTF-8 bytes (token id = byte value), for byte-level models."""

    eos_token_id = None

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    @staticmethod
    def token_id(text: str) -> int:
        raw = text.encode("utf-8")
        if len(raw) != 1:
            raise ValueError(f"generate: --stop {text!r} is {len(raw)} bytes; a byte-level model stops at one byte.")
        return raw[0]


class _TokenizerCodec:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, text: str) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("generate: --chat needs a tokenizer with a chat_template; drop --chat or pass one.")
        messages = [{"role": "user", "content": text}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_rendered(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_id(self, text: str) -> int:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"generate: --stop {text!r} is {len(ids)} tokens of this tokenizer; give one token "
                             "(e.g. the chat template's end-of-turn marker).")  # fmt: skip
        return int(ids[0])


def _codec(tokenizer_dir: str | None, loaded: LoadedModel) -> _ByteCodec | _TokenizerCodec:
    from lightning_moe.data.tokenizer import load_tokenizer

    folder = tokenizer_dir or loaded.tokenizer_dir
    if folder is not None:
        tokenizer = load_tokenizer(folder, owner="generate")
        if len(tokenizer) > loaded.vocab_size:
            raise ValueError(f"generate: the tokenizer in {folder!r} has {len(tokenizer)} tokens but the model's "
                             f"vocab_size is {loaded.vocab_size}; pass the tokenizer the model was trained "
                             "with.")  # fmt: skip
        return _TokenizerCodec(tokenizer)
    if loaded.vocab_size <= BYTE_VOCAB:
        return _ByteCodec()
    raise ValueError(f"generate: the model has vocab_size={loaded.vocab_size} (not byte-level) and no tokenizer "
                     "was given; pass --tokenizer <folder with the tokenizer it was trained with>.")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-moe generate", description="Sample text from a trained model.")
    p.add_argument("--checkpoint", required=True, help=".ckpt file, DCP checkpoint directory or HF model directory")
    p.add_argument("--tokenizer", default=None, help="folder with the saved tokenizer (none: bytes)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="argmax at every step (same as --temperature 0)")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn (chat template)")
    p.add_argument("--stop", action="append", default=[], help="also stop at this token (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--swap_moe", action="store_true", help="swap an HF model's MoE blocks for lightning-moe's")
    p.add_argument("--show_ids", action="store_true", help="also print the new token ids")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``), generate, print prompt and continuation."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _check_sampling(args.temperature, args.top_p)
        loaded = load_model(args.checkpoint, swap_moe=args.swap_moe, device=args.device)
        codec = _codec(args.tokenizer, loaded)
        prompt = args.prompt
        if args.chat:
            if not isinstance(codec, _TokenizerCodec):
                raise ValueError("generate: --chat needs a tokenizer with a chat template; pass --tokenizer.")
            prompt = codec.chat_prompt(args.prompt)
            prompt_ids = codec.encode_rendered(prompt)
        else:
            prompt_ids = codec.encode(prompt)
        stop = [codec.token_id(text) for text in args.stop]
        if codec.eos_token_id is not None:
            stop.append(codec.eos_token_id)
        new = generate_ids(
            loaded.forward, prompt_ids, args.max_new_tokens, args.temperature, args.top_p, args.greedy,
            eos_id=stop, seed=args.seed, max_context=loaded.max_context, device=args.device,
        )  # fmt: skip
    except (ValueError, TypeError, OSError, ImportError) as exc:
        raise SystemExit(str(exc).strip().splitlines()[0]) from None
    print(prompt + codec.decode(new), flush=True)
    if args.show_ids:
        print("ids:", " ".join(map(str, new)), flush=True)
