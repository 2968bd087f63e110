"""Vocabulary-parallel embedding, output head and cross-entropy over the tensor-parallel group.

Legend: T tokens, B batch, S sequence, s = S/tp, H hidden, V vocabulary, v = V/tp this rank's
slice of it, starting at ``vocab_start = tp_rank * v``.

* :class:`VocabParallelEmbedding`: rows ``[vocab_start, vocab_start + v)`` of the table on each
  TP rank (a ``Shard(0)`` DTensor over the TP mesh). Lookup of the ids in range (others give
  zero rows), then all-reduce(TP) — or, with sequence parallel, reduce-scatter(TP) along the
  sequence, which leaves each rank its ``[B, s, H]`` slice.
* The head is a column-parallel ``lm_head`` (``ColwiseParallel``): each rank produces its
  ``[..., v]`` logits; :func:`mark_vocab_parallel_head` records the group and ``vocab_start``
  on it, which :func:`lm_cross_entropy` reads.
* :func:`vocab_parallel_cross_entropy`: per-token loss from the local logits without any rank
  building ``[T, V]``. Forward: max (all-reduce MAX), sum of exponentials (all-reduce SUM) and
  the target's logit (zero off this rank's slice, all-reduce SUM). Backward (local):
  ``softmax - onehot`` on this rank's slice, times the loss gradient.

Tied embeddings and a vocabulary not divisible by TP are refused by ``parallelize_moe_model``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_moe.moe.dispatch.comm import reduce_from_group
from lightning_moe.ops.backend import csrc_extension
from lightning_moe.ops.cross_entropy import token_cross_entropy
from lightning_moe.parallel.sequence import reduce_scatter_to_sequence

__all__ = [
    "VocabParallelEmbedding",
    "lm_cross_entropy",
    "mark_vocab_parallel_head",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_head",
]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits_Tv: torch.Tensor, labels_T: torch.Tensor, group: ProcessGroup, vocab_start: int, ignore_index: int
    ) -> torch.Tensor:
        logits_Tv = logits_Tv.float()
        v = logits_Tv.shape[-1]
        max_T = logits_Tv.max(dim=-1).values
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
        shifted_Tv = logits_Tv - max_T.unsqueeze(-1)
        exp_Tv = shifted_Tv.exp()
        sum_exp_T = exp_Tv.sum(-1)
        local_T = labels_T - vocab_start
        mine_T = (local_T >= 0) & (local_T < v) & (labels_T != ignore_index)
        index_T = torch.where(mine_T, local_T, torch.zeros_like(local_T))
        target_T = shifted_Tv.gather(1, index_T.unsqueeze(1)).squeeze(1) * mine_T
        both_2T = torch.stack([sum_exp_T, target_T])
        dist.all_reduce(both_2T, group=group)
        sum_exp_T, target_T = both_2T[0], both_2T[1]
        keep_T = labels_T != ignore_index
        loss_T = (sum_exp_T.log() - target_T) * keep_T
        ctx.save_for_backward(exp_Tv, sum_exp_T, index_T, mine_T, keep_T)
        return loss_T

    @staticmethod
    def backward(ctx: Any, grad_T: torch.Tensor):  # type: ignore[override]
        exp_Tv, sum_exp_T, index_T, mine_T, keep_T = ctx.saved_tensors
        grad_Tv = exp_Tv / sum_exp_T.unsqueeze(-1)
        grad_Tv.scatter_add_(1, index_T.unsqueeze(1), -mine_T.to(grad_Tv.dtype).unsqueeze(1))
        grad_Tv *= (grad_T * keep_T).unsqueeze(-1)
        return grad_Tv, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local_TV: torch.Tensor,
    labels_T: torch.Tensor,
    tp_group: ProcessGroup,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy ``[T]`` (fp32; 0 where ``labels == ignore_index``) from each TP
    rank's logits ``[T, v]`` of vocabulary ids ``[vocab_start, vocab_start + v)``.

    Equals ``F.cross_entropy(full_logits, labels, reduction="none", ignore_index=...)``; every
    rank of ``tp_group`` gets the same losses. Collectives: two all-reduces over ``tp_group``.
    """
    if logits_local_TV.dim() != 2 or labels_T.dim() != 1 or labels_T.shape[0] != logits_local_TV.shape[0]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits_local_TV.shape)} and labels {tuple(labels_T.shape)} "
            "must be [T, v] and [T]; flatten the batch and sequence dims first."
        )
    if labels_T.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"vocab_parallel_cross_entropy: labels dtype={labels_T.dtype}; pass integer token ids.")
    return _VocabParallelCE.apply(logits_local_TV, labels_T.long(), tp_group, int(vocab_start), int(ignore_index))


class VocabParallelEmbedding(nn.Module):
    """``forward(ids[B, S]) -> [B, S, H]`` (``[B, s, H]`` with sequence parallel); the table's
    rows are split over the TP group.

    ``weight`` is a ``Shard(0)`` DTensor over ``tp_mesh`` with the full ``[V, H]`` shape, so
    checkpoints and ``full_tensor`` see the whole table.
    """

    def __init__(self, embedding: nn.Embedding, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        V, H = embedding.weight.shape
        tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
        if V % tp:
            raise ValueError(
                f"VocabParallelEmbedding: vocab_size={V} is not divisible by tp={tp}; pad the vocabulary to a "
                f"multiple of {tp} (e.g. {-(-V // tp) * tp}) or set vocab_parallel=False."
            )
        self.num_embeddings, self.embedding_dim = V, H
        self.vocab_start, self.vocab_size_local = rank * (V // tp), V // tp
        self.sequence_parallel = sequence_parallel
        self.group = tp_mesh.get_group()
        local = embedding.weight.detach()[self.vocab_start : self.vocab_start + self.vocab_size_local].clone()
        dt = DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False, shape=(V, H), stride=(H, 1))
        self.weight = nn.Parameter(dt, requires_grad=embedding.weight.requires_grad)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        weight_vH = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        local_BS = ids_BS - self.vocab_start
        mine_BS = (local_BS >= 0) & (local_BS < self.vocab_size_local)
        rows_BSH = F.embedding(torch.where(mine_BS, local_BS, torch.zeros_like(local_BS)), weight_vH)
        partial_BSH = rows_BSH * mine_BS.unsqueeze(-1).to(rows_BSH.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial_BSH, self.group, dim=1)
        return reduce_from_group(partial_BSH, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, "
            f"{self.vocab_start + self.vocab_size_local}), sequence_parallel={self.sequence_parallel}"
        )


def mark_vocab_parallel_head(head: nn.Module, tp_group: ProcessGroup, vocab_start: int) -> None:
    """Record on ``head`` that its output is the ``[..., v]`` slice from ``vocab_start`` over ``tp_group``."""
    head.vocab_parallel_group = tp_group  # type: ignore[assignment]
    head.vocab_start = vocab_start  # type: ignore[assignment]


def vocab_parallel_head(model: nn.Module) -> nn.Module | None:
    """The vocab-parallel output head under ``model`` (marked by :func:`mark_vocab_parallel_head`), or ``None``."""
    for m in model.modules():
        if getattr(m, "vocab_parallel_group", None) is not None:
            return m
    return None


def lm_cross_entropy(
    model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean token cross-entropy of ``logits [..., V or v]`` against ``labels [...]`` (fp32).

    The vocab-parallel loss when ``model`` holds a vocab-parallel head (its logits are this
    rank's vocabulary slice), else the plain cross-entropy (on CUDA ``ops.cross_entropy``'s kernel,
    read from the logits' dtype); both average over the labels that are not ``ignore_index``.
    """
    labels_T = labels.flatten()
    head = vocab_parallel_head(model)
    if head is None:
        if csrc_extension(logits) is not None:  # CUDA: from the logits' dtype, no fp32 copy of [T, V]
            loss_T = token_cross_entropy(logits.flatten(0, -2), labels_T, ignore_index)
            return loss_T.sum() / (labels_T != ignore_index).sum()
        return F.cross_entropy(logits.flatten(0, -2).float(), labels_T, ignore_index=ignore_index)
    logits_TV = logits.flatten(0, -2).float()
    loss_T = vocab_parallel_cross_entropy(logits_TV, labels_T, head.vocab_parallel_group, head.vocab_start, ignore_index)
    return loss_T.sum() / (labels_T != ignore_index).sum()
