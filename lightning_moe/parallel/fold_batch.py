"""A batch under context parallel: this rank's sequence chunks and a loss equal to one process.

Legend: B batch, S sequence, s = S/cp local sequence, V vocabulary (or its TP slice).

Context parallel (CP) cuts every sequence of a data-parallel replica's batch into ``2*cp`` equal
chunks; CP rank r holds chunks r and ``2*cp-1-r`` (``parallel/context.py``'s
``cp_chunk_positions``: every rank gets the same share of the causal attention work). Stages:

1. :func:`shard_batch` (no collective): the length check (a multiple of ``2*cp``, named with the
   multiple), ``position_ids`` added as the global positions when the batch has none (packed
   batches bring their own, restarting per document), then every ``[B, S]`` tensor of the batch
   (``input_ids``, ``labels``, ``position_ids``, ``document_ids``) cut to this rank's chunks;
2. :func:`lm_token_mean_loss`: the step's loss is the mean over *all* labelled tokens of the
   micro-batch on every data-parallel and context-parallel rank (``ignore_index`` excluded), which
   the ranks hold in unequal numbers when labels are masked or packed. Each rank returns
   ``n * sum_local / count`` over the ``n = dp*cp`` ranks of ``group`` (the counts summed over it:
   one all-reduce of one number), so FSDP's gradient average over ``dp x cp`` is exactly the
   gradient of that mean, as one process computes it on the whole batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["IGNORE_INDEX", "ContextParallel", "check_sequence_length", "lm_token_mean_loss", "shard_batch", "token_mean_loss"]

IGNORE_INDEX = -100  # labels left out of the loss (F.cross_entropy's default)
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids")


class ContextParallel(NamedTuple):
    """The CP group (``None`` without context parallel), its size and this rank's coordinate."""

    group: Any
    size: int
    rank: int


def check_sequence_length(owner: str, seq_len: int, cp_size: int) -> None:
    """``seq_len`` must be a multiple of ``2*cp_size`` (the load-balanced chunks); ``ValueError`` otherwise."""
    multiple = 2 * cp_size
    if seq_len % multiple:
        lower, upper = seq_len - seq_len % multiple, seq_len - seq_len % multiple + multiple
        raise ValueError(
            f"{owner}: sequence length {seq_len} is not a multiple of 2*cp={multiple} (cp={cp_size} cuts each "
            f"sequence into {multiple} equal chunks); use a sequence length of {upper}"
            + (f" or {lower}" if lower else "")
            + f" (any multiple of {multiple})."
        )


def shard_batch(
    batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int, owner: str = "shard_batch"
) -> dict[str, torch.Tensor]:
    """This CP rank's chunks of every ``[B, S]`` tensor of ``batch``; other entries are kept.

    ``cp_size == 1`` returns ``batch`` itself. Otherwise ``position_ids`` is added (``arange(S)``
    per row) when the batch has none, before cutting, so the model sees the global positions of
    its chunks. No collective.
    """
    if cp_size == 1:
        return batch
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise TypeError(
            f"{owner}: cp={cp_size} shards dict batches with an 'input_ids' [B, S] tensor; got "
            f"{type(batch).__name__}{'' if not isinstance(batch, dict) else ' with keys ' + str(sorted(batch))}."
        )
    input_ids_BS = batch["input_ids"]
    if input_ids_BS.dim() != 2:
        raise ValueError(f"{owner}: input_ids has shape {tuple(input_ids_BS.shape)}; pass [batch, sequence] token ids.")
    B, S = input_ids_BS.shape
    check_sequence_length(owner, S, cp_size)
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if value is not None and tuple(value.shape[:2]) != (B, S):
            raise ValueError(
                f"{owner}: batch[{key!r}] has shape {tuple(value.shape)}, input_ids {(B, S)}; every per-token "
                "entry must match input_ids."
            )
    from lightning_moe.parallel.context import shard_sequence

    out = dict(batch)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(S, device=input_ids_BS.device).expand(B, S)
    for key in SEQUENCE_KEYS:
        if out.get(key) is not None:
            out[key] = shard_sequence(out[key], cp_size, cp_rank, dim=1)
    return out


def token_mean_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor, group: Any, ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranks * loss_sum / count, count)`` with ``count`` the labelled tokens summed over ``group``.

    ``loss_sum`` is this rank's sum of per-token losses over ``num_tokens`` labelled tokens and
    ``ranks`` the size of ``group`` (whose gradients are averaged). Without a group it is the plain
    mean. No labelled token anywhere gives 0 (not NaN). Collective: one all-reduce of
    ``num_tokens`` over ``group`` (counts carry no gradient).
    """
    count = num_tokens.detach().to(torch.float32).reshape(()).clone()
    if group is not None and ranks > 1:
        dist.all_reduce(count, group=group)
    else:
        ranks = 1
    return loss_sum * (ranks / count.clamp(min=1.0)).to(loss_sum.dtype), count


def lm_token_mean_loss(
    model: torch.nn.Module, logits_BsV: torch.Tensor, labels_Bs: torch.Tensor, group: Any = None, ranks: int = 1
) -> torch.Tensor:
    """Next-token loss of this rank's share of the mean over every labelled token of ``group``.

    ``lm_cross_entropy`` (``parallel/vocab.py``) gives the per-token losses (vocab-parallel heads
    included). Without ``group`` this is the plain mean over the local labelled tokens;
    with it, :func:`token_mean_loss` of the local sum (the strategy's ``loss_group``: ``dp_cp``).
    """
    mean = _mean_cross_entropy(model, logits_BsV, labels_Bs)
    if group is None or ranks == 1:
        return mean
    count = (labels_Bs != IGNORE_INDEX).sum()
    # no labelled token here: the sum is 0, kept in the graph (the mean of nothing is NaN)
    loss_sum = mean * count if bool(count > 0) else logits_BsV.sum() * 0.0  # SYNC: one count per micro-batch
    return token_mean_loss(loss_sum, count, group, ranks)[0]


def _mean_cross_entropy(model: torch.nn.Module, logits_BsV: torch.Tensor, labels_Bs: torch.Tensor) -> torch.Tensor:
    try:
        from lightning_moe.parallel.vocab import lm_cross_entropy
    except ImportError:
        return torch.nn.functional.cross_entropy(logits_BsV.flatten(0, 1).float(), labels_Bs.flatten())
    return lm_cross_entropy(model, logits_BsV, labels_Bs)
