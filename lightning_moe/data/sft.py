"""Supervised fine-tuning on chats: the tokenizer's chat template, loss on the assistant's tokens only.

Legend: T tokens of one rendered chat.

A chat is a list of messages ``{"role": str, "content": str}`` with at least one ``"assistant"``
turn. :func:`tokenize_chat` renders it with the tokenizer's chat template and returns the token
ids and an assistant mask (1 on every token the assistant's turns produced: their content and the
end-of-turn text the template writes after it; 0 on system/user turns and the role headers):

* a template with ``{% generation %}`` blocks: transformers' own
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
* any other template: the assistant spans are found by rendering prefixes. For the ``i``-th
  message, an assistant turn, the text of ``messages[:i]`` with the generation prompt is where its
  span starts and the text of ``messages[:i + 1]`` where it ends; the whole chat's text must start
  with both (a template that rewrites earlier turns, e.g. drops their reasoning, cannot be split
  this way and is refused: add ``{% generation %}`` to it). The full text is tokenized once, and a
  token is an assistant token when its characters overlap a span.

:func:`chat_example` turns ids and mask into next-token training pairs: ``labels[j]`` is
``ids[j + 1]`` where token ``j + 1`` is an assistant token, else -100, so the loss (a mean over
labelled tokens) counts only what the assistant says.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lightning_moe.data.packing import IGNORE_INDEX

__all__ = ["chat_example", "check_messages", "has_generation_blocks", "tokenize_chat"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_blocks(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant output with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and _GENERATION.search(template) is not None


def check_messages(messages: Any, where: str = "") -> list[dict[str, str]]:
    """``messages`` if it is a chat with an assistant turn, else ``ValueError`` naming ``where``."""
    at = f"{where}: " if where else ""
    if not isinstance(messages, list) or not messages:
        got = type(messages).__name__ if not isinstance(messages, list) else "an empty list"
        raise ValueError(f"tokenize_chat: {at}messages is {got}; give a list of {{role, content}} messages.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"tokenize_chat: {at}message {i} is {m!r}; each message needs a str 'role' and "
                             "a str 'content'.")  # fmt: skip
    if not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise ValueError(f"tokenize_chat: {at}the chat has no assistant turn (roles {roles}), so nothing to learn; "
                         "drop the sample or add the assistant's reply.")  # fmt: skip
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _spans_by_prefixes(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True) if i else ""
        end = _render(tokenizer, messages[: i + 1], False)
        if not (end.startswith(start) and full.startswith(end)):
            at = f"{where}: " if where else ""
            raise ValueError(
                f"tokenize_chat: {at}the chat template renders turn {i} differently once later turns follow, so "
                "the assistant's tokens cannot be found from rendered prefixes; mark the assistant output in the "
                "template with {% generation %} ... {% endgeneration %}."
            )
        spans.append((len(start), len(end)))
    return full, spans


def tokenize_chat(tokenizer: Any, messages: Any, where: str = "") -> tuple[list[int], list[int]]:
    """``(ids, assistant_mask)`` of one chat, both of length T (module doc).

    Raises ``ValueError`` naming ``where`` (e.g. ``"data.jsonl:7"``) for a malformed chat, one
    without an assistant turn, or one whose assistant turns hold no token.
    """
    messages = check_messages(messages, where)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenize_chat: the tokenizer has no chat_template; use a tokenizer saved with one "
                         "(tokenizer.chat_template = '...') or train on plain text.")  # fmt: skip
    if has_generation_blocks(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = list(out["input_ids"]), [int(v) for v in out["assistant_masks"]]
    else:
        full, spans = _spans_by_prefixes(tokenizer, messages, where)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    if not any(mask):
        at = f"{where}: " if where else ""
        raise ValueError(f"tokenize_chat: {at}the assistant turns render to no token (empty replies?); "
                         "drop the sample or give the assistant's reply.")  # fmt: skip
    return ids, mask


def chat_example(ids_T: list[int] | torch.Tensor, mask_T: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"input_ids": ids[:-1], "labels": ...}`` int64 ``[T - 1]``: labels only where the next token is
    the assistant's (module doc)."""
    ids = torch.as_tensor(ids_T, dtype=torch.int64)
    mask = torch.as_tensor(mask_T, dtype=torch.bool)
    if ids.shape != mask.shape or ids.dim() != 1:
        raise ValueError(f"chat_example: ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must be one 1-D shape.")
    return {"input_ids": ids[:-1], "labels": torch.where(mask[1:], ids[1:], IGNORE_INDEX)}
