"""Packed sequences: documents laid end to end in fixed-length rows, with document and position ids.

Legend: R rows, S sequence length (``seq_len``), B batch, T tokens of a stream, G segments.

A row holds ``seq_len + 1`` tokens ``t_0 .. t_S``: whole documents, each followed by one EOS
token, one after the other in their given order (next fit: a document that does not fit in what
is left of the row starts the next row), and padding to the end. A row becomes one example::

    input_ids     t_0 .. t_{S-1}
    labels        t_1 .. t_S, except -100 where t_{j+1} is in another document than t_j
                  (the EOS of a document is its last label; nothing predicts across a boundary)
                  and at padding
    document_ids  0, 0, .., 1, 1, .., k (padding: its own id after the last document's);
                  non-decreasing within a row, restarting at 0 in every row
    position_ids  0, 1, .. within each document, restarting at 0 at each one (padding too)

all int64 ``[S]``. So a model whose attention never crosses a document computes, for every
labelled token of a packed row, the loss it computes on that document alone (packed in a row of
its own). Empty documents add no label and are skipped.

A document longer than a row (``len + 1 > seq_len + 1`` with its EOS) is, by ``long_documents``:

* ``"split"``: cut into pieces that overlap by one token, so each of its labels is used exactly
  once: the first piece fills what is left of the current row, each later one starts a row. Each
  piece is a document of its own (attention does not reach back into the previous piece).
* ``"truncate"``: its first ``seq_len + 1`` tokens fill one row (no EOS); the rest is dropped.
* ``"error"``: ``ValueError`` naming the document's index and length.

:func:`check_packed_batch` validates a batch (shapes, monotone document ids, position ids that
restart at each document, no label across a boundary) for the model and the strategies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch.utils.data import Dataset

__all__ = [
    "IGNORE_INDEX",
    "PACKED_KEYS",
    "PAD_SLOT",
    "LongDocuments",
    "PackedDataset",
    "PackingMode",
    "check_packed_batch",
    "document_ids_from_lengths",
    "layout_units",
    "packed_example",
    "pack_documents",
    "position_ids_from_document_ids",
]

PackingMode = Literal["none", "pack"]
LongDocuments = Literal["split", "truncate", "error"]
PACKING_MODES = ("none", "pack")
LONG_DOCUMENTS = ("split", "truncate", "error")
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
PACKED_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
PAD_SLOT = -1  # document slot of padding in a stored row


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: {name}={value!r} is unknown; choose one of {list(choices)}.")


def layout_units(
    starts: list[int], lengths: list[int], row_len: int, long_documents: str, owner: str
) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """Place units (a document and its EOS: ``lengths[d]`` tokens from ``starts[d]`` of the stream).

    Returns segments ``(row, offset, src, length, slot)`` (``slot``: the segment's document id in its
    row) and the number of rows. Units of one token (an empty document: its EOS only) are skipped.
    """
    segments: list[tuple[int, int, int, int, int]] = []
    row, offset, slot = 0, 0, 0

    def new_row() -> None:
        nonlocal row, offset, slot
        if offset:
            row, offset, slot = row + 1, 0, 0

    def place(src: int, n: int) -> None:
        nonlocal offset, slot
        segments.append((row, offset, src, n, slot))
        offset, slot = offset + n, slot + 1
        if row_len - offset < 2:  # no room for a token with a label
            new_row()

    for index, (src, n) in enumerate(zip(starts, lengths)):
        if n < 2:
            continue
        if n <= row_len:
            if offset + n > row_len:
                new_row()
            place(src, n)
        elif long_documents == "error":
            raise ValueError(
                f"{owner}: document {index} has {n - 1} tokens ({n} with its EOS), more than a row of "
                f"seq_len + 1 = {row_len} tokens holds; set long_documents='split' or 'truncate', or raise seq_len."
            )
        elif long_documents == "truncate":
            new_row()
            place(src, row_len)
        else:  # split: pieces overlap by one token (a piece's last token is the next one's first input)
            end = src + n
            while True:
                take = min(row_len - offset, end - src)
                place(src, take)
                if src + take == end:
                    break
                src += take - 1
    return segments, row + (1 if offset else 0)


def _pack(stream: torch.Tensor, starts: list[int], lengths: list[int], seq_len: int, long_documents: str,
          owner: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(tokens [R, S+1], slots [R, S+1])`` of the packed rows, in ``stream``'s dtype and int32;
    padding holds token 0 and slot ``PAD_SLOT``."""
    row_len = seq_len + 1
    segments, rows = layout_units(starts, lengths, row_len, long_documents, owner)
    tokens = torch.zeros(rows, row_len, dtype=stream.dtype)
    slots = torch.full((rows, row_len), PAD_SLOT, dtype=torch.int32)
    if not segments:
        return tokens, slots
    seg_row, seg_off, seg_src, seg_len, seg_slot = torch.tensor(segments, dtype=torch.int64).unbind(1)
    seg_of_token = torch.repeat_interleave(torch.arange(len(segments)), seg_len)
    first = torch.cumsum(seg_len, 0) - seg_len
    within = torch.arange(int(seg_len.sum())) - first[seg_of_token]
    r, c = seg_row[seg_of_token], seg_off[seg_of_token] + within
    tokens[r, c] = stream[seg_src[seg_of_token] + within]
    slots[r, c] = seg_slot[seg_of_token].to(torch.int32)
    return tokens, slots


def packed_example(tokens_S1: torch.Tensor, slots_S1: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """One stored row as the four int64 ``[S]`` tensors (module doc)."""
    pad = slots_S1 == PAD_SLOT
    # Padding: the document id after the row's last one.
    doc_S1 = torch.where(pad, int(slots_S1.max()) + 1, slots_S1).long()
    tokens = torch.where(pad, pad_id, tokens_S1.long())
    same = (doc_S1[1:] == doc_S1[:-1]) & ~pad[:-1]
    document_ids = doc_S1[:-1]
    return {
        "input_ids": tokens[:-1],
        "labels": torch.where(same, tokens[1:], IGNORE_INDEX),
        "position_ids": position_ids_from_document_ids(document_ids.unsqueeze(0))[0],
        "document_ids": document_ids,
    }


def _check_args(owner: str, seq_len: int, eos_id: int, long_documents: str) -> None:
    for name, value, low in (("seq_len", seq_len, 1), ("eos_id", eos_id, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{owner}: {name}={value!r} must be an int >= {low}.")
    check_choice(owner, "long_documents", long_documents, LONG_DOCUMENTS)


def pack_documents(
    documents: Sequence[Sequence[int] | torch.Tensor],
    seq_len: int,
    eos_id: int,
    long_documents: LongDocuments = "split",
) -> dict[str, torch.Tensor]:
    """Pack ``documents`` (token id lists or 1-D integer tensors) into rows: the four keys, ``[R, seq_len]``.

    Each document is followed by ``eos_id``; padding carries ``eos_id`` too (its labels are -100).
    Deterministic: the rows depend only on the documents, their order and the arguments.
    """
    owner = "pack_documents"
    _check_args(owner, seq_len, eos_id, long_documents)
    parts, starts, lengths, at = [], [], [], 0
    for index, doc in enumerate(documents):
        t = doc if isinstance(doc, torch.Tensor) else torch.tensor(list(doc), dtype=torch.int64)
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(
                f"{owner}: document {index} has shape {tuple(t.shape)} and dtype {t.dtype}; pass 1-D integer ids."
            )
        parts.append(torch.cat([t.long(), torch.tensor([eos_id])]))
        starts.append(at)
        lengths.append(t.numel() + 1)
        at += t.numel() + 1
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    tokens, slots = _pack(stream, starts, lengths, seq_len, long_documents, owner)
    rows = [packed_example(tokens[i], slots[i], eos_id) for i in range(tokens.shape[0])]
    if not rows:
        return {k: torch.empty(0, seq_len, dtype=torch.int64) for k in PACKED_KEYS}
    return {k: torch.stack([r[k] for r in rows]) for k in PACKED_KEYS}


class PackedDataset(Dataset[dict[str, torch.Tensor]]):
    """Packed rows over a 1-D token stream whose documents end at ``eos_id`` tokens.

    The documents are the runs of ``tokens`` that end at an ``eos_id`` (a last run without one is
    packed without one); document ``i`` is the ``i``-th run, empty ones included, so that errors
    name the same index as a count of separators. Item ``i`` is row ``i`` as the four int64
    ``[seq_len]`` tensors of the module doc. Rows are built once, here (stored in the stream's
    dtype), so items are cheap and the order the sampler draws is the only order there is.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, eos_id: int, long_documents: LongDocuments = "split"
    ) -> None:
        owner = "PackedDataset"
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            got = f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
            raise ValueError(f"{owner}: tokens has {got}; pass a 1-D integer tensor.")
        _check_args(owner, seq_len, eos_id, long_documents)
        ends = ((tokens == eos_id).nonzero().flatten() + 1).tolist()
        if not ends or ends[-1] != tokens.numel():
            ends.append(tokens.numel())
        starts = [0, *ends[:-1]]
        lengths = [e - s for s, e in zip(starts, ends)]
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.long_documents = long_documents
        self.num_documents = sum(n > 1 for n in lengths)  # those with a label: what is packed
        self.rows, self.slots = _pack(tokens, starts, lengths, seq_len, long_documents, owner)
        if self.rows.shape[0] == 0:
            raise ValueError(
                f"{owner}: the {tokens.numel()} tokens hold no document with a label (only eos_id={eos_id} "
                "separators); supply text, or check eos_id."
            )

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"PackedDataset: index {index} out of range for {len(self)} rows")
        return packed_example(self.rows[index], self.slots[index], self.eos_id)

    def fill(self) -> float:
        """Fraction of input positions that hold a document token (not padding)."""
        return float((self.slots[:, :-1] != PAD_SLOT).float().mean()) if len(self) else 0.0


def position_ids_from_document_ids(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (0 at each change of id along S): int64 ``[B, S]``."""
    B, S = document_ids_BS.shape
    arange_BS = torch.arange(S, device=document_ids_BS.device).expand(B, S)
    start_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    start_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    first_BS = torch.where(start_BS, arange_BS, 0).cummax(dim=1).values
    return arange_BS - first_BS


def document_ids_from_lengths(lengths: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Document ids ``[B, seq_len]`` from each row's document lengths (``[[3, 2, 5], ...]``).

    Raises ``ValueError`` when a row's lengths are not positive ints adding up to ``seq_len``.
    """
    rows = []
    for r, row in enumerate(lengths):
        row = list(row)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in row) or sum(row) != seq_len:
            raise ValueError(
                f"document_ids_from_lengths: row {r} has document lengths {row} (sum {sum(row)}), which must be "
                f"positive ints adding up to seq_len={seq_len}; count padding as a document of its own."
            )
        rows.append(torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row, dtype=torch.int64)))
    return torch.stack(rows) if rows else torch.empty(0, seq_len, dtype=torch.int64)


def _first_bad(bad_BS: torch.Tensor) -> tuple[int, int] | None:
    hits = bad_BS.nonzero()
    return (int(hits[0, 0]), int(hits[0, 1])) if hits.numel() else None


def check_packed_batch(batch: Mapping[str, torch.Tensor], *, continued_rows: bool = False) -> None:
    """Raise ``ValueError`` unless ``batch`` is a consistent packed batch.

    Checks: ``input_ids``, ``document_ids`` and ``position_ids`` (and ``labels`` when present) are
    integer tensors of one shape ``[B, S]``; document ids are >= 0 and non-decreasing along each
    row; position ids are 0 at the start of every document and grow by one within it; a label is
    -100 where the next token belongs to another document. ``continued_rows=True`` lets a row's
    first document start at any position >= 0 (a row cut from a longer one, e.g. a
    context-parallel shard).
    """
    owner = "check_packed_batch"
    required = ("input_ids", "document_ids", "position_ids")
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"{owner}: the batch lacks {missing} (has {sorted(batch)}); build it with packing='pack'.")
    shape = None
    for key in (*required, "labels"):
        if key not in batch:
            continue
        t = batch[key]
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype)
            raise ValueError(f"{owner}: {key} is {got}; pass an integer tensor [B, S].")
        if t.dim() != 2 or (shape is not None and tuple(t.shape) != shape):
            want = "[B, S]" if shape is None else f"{list(shape)} like input_ids"
            raise ValueError(f"{owner}: {key} has shape {list(t.shape)}; it must be {want}.")
        shape = tuple(t.shape)
    doc, pos = batch["document_ids"], batch["position_ids"]
    if doc.numel() == 0:
        return
    if (where := _first_bad(doc < 0)) is not None:
        raise ValueError(f"{owner}: document_ids[{where[0]}, {where[1]}]={int(doc[where])} is negative; ids are >= 0.")
    if (where := _first_bad(doc[:, 1:] < doc[:, :-1])) is not None:
        r, j = where
        raise ValueError(
            f"{owner}: document_ids decrease in row {r} at token {j + 1} ({int(doc[r, j])} -> {int(doc[r, j + 1])}); "
            "a row's document ids must be non-decreasing (one id per document, in order)."
        )
    expected = position_ids_from_document_ids(doc.long())
    if continued_rows:  # the first document of a row may start anywhere
        first_doc = doc == doc[:, :1]
        expected = torch.where(first_doc, expected + pos[:, :1].long(), expected)
        if (where := _first_bad(pos[:, :1] < 0)) is not None:
            raise ValueError(f"{owner}: position_ids[{where[0]}, 0]={int(pos[where[0], 0])} is negative.")
    if (where := _first_bad(pos.long() != expected)) is not None:
        r, j = where
        raise ValueError(
            f"{owner}: position_ids[{r}, {j}]={int(pos[r, j])} but that token is at {int(expected[r, j])} in its "
            f"document (document_ids[{r}, {j}]={int(doc[r, j])}); position ids restart at 0 at each document and "
            "grow by one (position_ids_from_document_ids builds them)."
        )
    if "labels" in batch:
        labels = batch["labels"]
        crossing = (doc[:, 1:] != doc[:, :-1]) & (labels[:, :-1] != IGNORE_INDEX)
        if (where := _first_bad(crossing)) is not None:
            r, j = where
            raise ValueError(
                f"{owner}: labels[{r}, {j}]={int(labels[r, j])} is the next document's token (document_ids "
                f"{int(doc[r, j])} -> {int(doc[r, j + 1])}); attention does not cross documents, so set it to -100."
            )
