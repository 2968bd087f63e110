"""Context parallelism: a sequence sharded over the CP group, and causal attention across it.

Legend: B batch, N query heads, Nk key/value heads, S global sequence length, s = S / cp local
length, D head dim, Dv value head dim, c cp ranks, b a block of local queries.

Sharding is load-balanced for a causal mask: the sequence is cut into ``2·cp`` equal chunks and
rank ``r`` holds chunks ``r`` and ``2·cp - 1 - r`` (an early chunk, whose queries read few keys,
with a late one, whose queries read many), so every rank does the same attention work.

``context_parallel_attention`` is one autograd function. Forward all-gathers K/V (one collective)
and the key positions / document ids (another) over the group, and computes the local queries'
attention over all keys block by block in fp32 (no ``[s, S]`` score matrix is ever whole). It
saves only local tensors: ``q``, ``k``, ``v``, the output and its per-query logsumexp. Backward
all-gathers K/V again, recomputes the probabilities from the logsumexp, and sends each rank the sum
of every rank's dK/dV for its own keys (``parallel/collectives.py``: ``all_gather_cat``,
``reduce_scatter_cat``). The memory kept for backward per rank is therefore
``1/cp`` of a single-rank run's.

The mask is the one of ``models/attention.py``: key position ``<=`` query position and, with
document ids, the same document. The group's ranks must hold the same batch rows (same ``B``).
The model hands the group to its own attention modules (``models/context_parallel.py``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_moe.parallel.attention_shapes import check_attention_shapes
from lightning_moe.parallel.collectives import all_gather_cat, reduce_scatter_cat

__all__ = [
    "context_parallel_attention",
    "cp_chunk_positions",
    "shard_sequence",
    "unshard_sequence",
]

# scores of one query block [B, N, b, S] in fp32: about 16 MiB on CPU, 512 MiB on an accelerator
_BLOCK_ELEMENTS = 1 << 22
_BLOCK_ELEMENTS_ACCELERATOR = 1 << 27


def _check_cp(owner: str, cp_size: int, cp_rank: int) -> None:
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}: {name}={value!r} must be an int.")
    if cp_size < 1:
        raise ValueError(f"{owner}: cp_size={cp_size} must be >= 1.")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"{owner}: cp_rank={cp_rank} must be in [0, cp_size={cp_size}).")


def cp_chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``S / cp`` global positions rank ``cp_rank`` holds, in order: chunks ``cp_rank`` and
    ``2·cp - 1 - cp_rank`` of ``2·cp`` equal chunks. ``seq_len`` must be a multiple of ``2·cp``."""
    _check_cp("cp_chunk_positions", cp_size, cp_rank)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise TypeError(f"cp_chunk_positions: seq_len={seq_len!r} must be an int >= 0.")
    multiple = 2 * cp_size
    if seq_len % multiple:
        raise ValueError(
            f"cp_chunk_positions: sequence length {seq_len} is not divisible by 2*cp={multiple}; pad or cut "
            f"the sequence to a multiple of {multiple} (e.g. {math.ceil(seq_len / multiple) * multiple})."
        )
    chunk = seq_len // multiple
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((multiple - 1 - cp_rank) * chunk, (multiple - cp_rank) * chunk, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` (sequence along ``dim``) that rank ``cp_rank`` holds (``cp_chunk_positions``)."""
    positions = cp_chunk_positions(x.shape[dim], cp_size, cp_rank, device=x.device)
    return x.index_select(dim, positions)


def unshard_sequence(shards: list[torch.Tensor], cp_size: int, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's ``shard_sequence`` part, in rank order (the inverse)."""
    if len(shards) != cp_size:
        raise ValueError(f"unshard_sequence: got {len(shards)} shards for cp_size={cp_size}; pass one per rank.")
    gathered = torch.cat(list(shards), dim=dim)
    S = gathered.shape[dim]
    order = torch.cat([cp_chunk_positions(S, cp_size, r, device=gathered.device) for r in range(cp_size)])
    return gathered.index_select(dim, torch.argsort(order))


# ----------------------------------------------------------------------------------------------
# blockwise attention math (fp32, or fp64 for fp64 inputs)


def _block_size(B: int, N: int, s: int, S: int, device: torch.device) -> int:
    budget = _BLOCK_ELEMENTS if device.type == "cpu" else _BLOCK_ELEMENTS_ACCELERATOR
    return max(1, min(s, budget // max(1, B * N * S)))


def _block_mask(
    pos_q_Bs: torch.Tensor,
    pos_k_BS: torch.Tensor,
    doc_q_Bs: torch.Tensor | None,
    doc_k_BS: torch.Tensor | None,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """``[B or 1, 1, 1, b, S]`` (broadcast over Nk and the query group): may query read key."""
    keep = pos_k_BS[:, None, :] <= pos_q_Bs[:, lo:hi, None]
    if doc_q_Bs is not None:
        keep = keep & (doc_k_BS[:, None, :] == doc_q_Bs[:, lo:hi, None])
    return keep[:, None, None]


def _scores(q_blk: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked scores ``[B, Nk, G, b, S]`` of pre-scaled queries (``-inf`` where masked)."""
    return torch.matmul(q_blk, k_all.unsqueeze(2).transpose(-1, -2)).masked_fill_(~mask, float("-inf"))


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # a query with no key reads zeros


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos_Bs: torch.Tensor,
        doc_Bs: torch.Tensor | None,
        scale: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        B, N, s, D = q.shape
        Nk, Dv = k.shape[1], v.shape[-1]
        G = N // Nk
        cdt = torch.promote_types(q.dtype, torch.float32)
        k_all, v_all, pos_k, doc_k = _gather_keys(k, v, pos_Bs, doc_Bs, group)
        k_all, v_all = k_all.to(cdt), v_all.to(cdt)
        q5 = q.to(cdt).reshape(B, Nk, G, s, D) * scale
        out5 = q.new_empty(B, Nk, G, s, Dv, dtype=cdt)
        lse = q.new_empty(B, Nk, G, s, dtype=cdt)
        step = _block_size(B, N, s, k_all.shape[2], q.device)
        for lo in range(0, s, step):
            hi = min(s, lo + step)
            scores = _scores(q5[..., lo:hi, :], k_all, _block_mask(pos_Bs, pos_k, doc_Bs, doc_k, lo, hi))
            row_max = _finite_or_zero(scores.amax(-1, keepdim=True))
            p = scores.sub_(row_max).exp_()  # unnormalised probabilities
            total = p.sum(-1, keepdim=True)
            out5[..., lo:hi, :] = torch.matmul(p, v_all.unsqueeze(2)).div_(total.clamp_min(torch.finfo(cdt).tiny))
            lse[..., lo:hi] = (row_max + total.log()).squeeze(-1)
        out = out5.view(B, N, s, Dv).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, pos_Bs, doc_Bs)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor):  # type: ignore[override]  # noqa: ANN205
        q, k, v, out, lse, pos_Bs, doc_Bs = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        B, N, s, D = q.shape
        Nk, Dv = k.shape[1], v.shape[-1]
        G = N // Nk
        cdt = lse.dtype
        k_all, v_all, pos_k, doc_k = _gather_keys(k, v, pos_Bs, doc_Bs, group)
        k_all, v_all = k_all.to(cdt), v_all.to(cdt)
        q5 = q.to(cdt).reshape(B, Nk, G, s, D) * scale
        do5 = dout.to(cdt).reshape(B, Nk, G, s, Dv)
        delta = (do5 * out.to(cdt).reshape(B, Nk, G, s, Dv)).sum(-1)  # [B, Nk, G, s]
        dq5 = torch.empty_like(q5)
        dk_all = torch.zeros_like(k_all)
        dv_all = torch.zeros_like(v_all)
        step = _block_size(B, N, s, k_all.shape[2], q.device)
        for lo in range(0, s, step):
            hi = min(s, lo + step)
            mask = _block_mask(pos_Bs, pos_k, doc_Bs, doc_k, lo, hi)
            p = _scores(q5[..., lo:hi, :], k_all, mask).sub_(_finite_or_zero(lse[..., lo:hi]).unsqueeze(-1)).exp_()
            do_blk = do5[..., lo:hi, :]
            dv_all += torch.matmul(p.transpose(-1, -2), do_blk).sum(2)
            dp = torch.matmul(do_blk, v_all.unsqueeze(2).transpose(-1, -2))
            ds = p.mul_(dp.sub_(delta[..., lo:hi].unsqueeze(-1)))  # d(scores), scores = (q * scale) k^T
            dq5[..., lo:hi, :] = torch.matmul(ds, k_all.unsqueeze(2)).mul_(scale)
            dk_all += torch.matmul(ds.transpose(-1, -2), q5[..., lo:hi, :]).sum(2)
        dkv = reduce_scatter_cat(torch.cat([dk_all, dv_all], dim=-1), group, dim=2)
        dk, dv = dkv.split([D, Dv], dim=-1)
        return dq5.view(B, N, s, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _gather_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    pos_Bs: torch.Tensor,
    doc_Bs: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every rank's keys, values, key positions and key document ids, concatenated along S."""
    D = k.shape[-1]
    kv_all = all_gather_cat(torch.cat([k, v.to(k.dtype)], dim=-1), group, dim=2)
    k_all, v_all = kv_all.split([D, v.shape[-1]], dim=-1)
    if doc_Bs is None:
        return k_all, v_all.to(v.dtype), all_gather_cat(pos_Bs, group, dim=1), None
    meta = all_gather_cat(torch.stack([pos_Bs.expand_as(doc_Bs), doc_Bs.to(pos_Bs.dtype)]), group, dim=2)
    return k_all, v_all.to(v.dtype), meta[0], meta[1]


def context_parallel_attention(
    q_BNsD: torch.Tensor,
    k_BNsD: torch.Tensor,
    v_BNsD: torch.Tensor,
    positions_s: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    document_ids_Bs: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, N, s, Dv]`` of this rank's queries over the keys of every rank of ``cp_group``.

    ``q [B, N, s, D]``, ``k [B, Nk, s, D]``, ``v [B, Nk, s, Dv]`` are this rank's tokens;
    ``positions_s`` (``[s]``, or ``[B, s]``) their global positions (``cp_chunk_positions``; with
    documents, positions that restart at each document work too); ``document_ids_Bs [B, s]`` their
    documents. ``cp_group=None`` (or a group of one) is single-rank attention by the same math.
    ``scale`` defaults to ``1/sqrt(D)``.
    """
    q, k, v = q_BNsD, k_BNsD, v_BNsD
    owner = "context_parallel_attention"
    check_attention_shapes(owner, q, k, v, same_length=True)
    B, _, s, D = q.shape
    if not isinstance(positions_s, torch.Tensor) or positions_s.dtype.is_floating_point or positions_s.shape not in ((s,), (B, s)):
        got = f"{positions_s.dtype} {tuple(positions_s.shape)}" if isinstance(positions_s, torch.Tensor) else type(positions_s).__name__
        raise ValueError(f"{owner}: positions_s must be an integer [{s}] or [{B}, {s}] tensor (cp_chunk_positions); got {got}.")
    if document_ids_Bs is not None and (
        not isinstance(document_ids_Bs, torch.Tensor) or document_ids_Bs.dtype.is_floating_point or document_ids_Bs.shape != (B, s)
    ):
        raise ValueError(f"{owner}: document_ids_Bs must be an integer [{B}, {s}] tensor.")
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"{owner}: cp_group={cp_group!r} must be a torch.distributed ProcessGroup or None.")
    pos_Bs = (positions_s if positions_s.dim() == 2 else positions_s[None]).to(torch.long)
    doc_Bs = None if document_ids_Bs is None else document_ids_Bs.to(torch.long)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return _ContextParallelAttention.apply(q, k, v, pos_Bs, doc_Bs, scale, cp_group)
