"""Single-rank causal attention core, with packed documents: ``attend`` and its backends.

Legend: B batch, N query heads, Nk key/value heads (N a multiple of Nk: grouped-query
attention), Sq query length, Sk key length, D head dim, Dv value head dim.

A packed row holds several documents one after another; ``document_ids[b, s]`` names the document
of token ``s`` of row ``b`` (non-decreasing along a row, so each document is one contiguous run).
A query attends to a key when both are in the same document and the key is not later than the
query. Positions, when given, decide "not later" (``pos_k <= pos_q``); without them the sequence
index does. Within one contiguous document, positions that restart at each document and the
sequence index give the same order, so either may be passed.

Backends (``TransformerConfig.attention_backend``):

``sdpa``          ``F.scaled_dot_product_attention``: ``is_causal=True`` (no mask tensor) when there
                  are no documents and no positions, a boolean ``[B, 1, Sq, Sk]`` mask otherwise.
``flex``          ``torch.nn.attention.flex_attention`` with a block mask built from the same rule
                  (compiled on CUDA; on CPU torch runs it in forward only, so a CPU call that needs
                  gradients is refused).
``flash_varlen``  ``flash_attn.flash_attn_varlen_func`` on CUDA in fp16/bf16: each document is one
                  variable-length sequence (``cu_seqlens`` from the document ids); order by sequence
                  index only (no positions).
``varlen``        ``torch.nn.attention.varlen.varlen_attn`` (torch's own flash kernel, forward and
                  backward) on CUDA in fp16/bf16 on a GPU of compute capability 8.0 or newer, head
                  dim a multiple of 8 up to 256: the same layout as ``flash_varlen``, without the
                  ``flash_attn`` package. Where that torch has no ``enable_gqa`` argument, key/value
                  heads are repeated to the query heads before the call.
``auto``          ``sdpa`` on CPU, and for rows without documents or with positions. On CUDA, for
                  packed fp16/bf16 rows: ``flash_varlen`` when ``flash_attn`` imports, else ``varlen``
                  when torch's varlen kernel can run them, else ``flex``, else ``sdpa``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from lightning_moe.parallel.attention_shapes import check_attention_shapes

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "attend",
    "causal_document_mask",
    "cu_seqlens_from_document_ids",
    "resolve_backend",
]

AttentionBackend = Literal["auto", "sdpa", "flex", "flash_varlen", "varlen"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

_HALF = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256  # torch's flash kernel: head dims up to 256, multiples of 8
_VARLEN_MIN_CAPABILITY = (8, 0)


def causal_document_mask(
    document_ids_q: torch.Tensor | None,
    document_ids_k: torch.Tensor | None,
    pos_q: torch.Tensor,
    pos_k: torch.Tensor,
) -> torch.Tensor:
    """Boolean ``[B, Sq, Sk]`` (``[1, Sq, Sk]`` without documents and with ``[S]`` positions):
    ``True`` where query ``q`` may read key ``k``: ``pos_k <= pos_q`` and, with document ids
    (``[B, Sq]`` and ``[B, Sk]``), the same document. Positions are ``[S]`` or ``[B, S]``."""
    pos_q_BQ = pos_q if pos_q.dim() == 2 else pos_q[None]
    pos_k_BK = pos_k if pos_k.dim() == 2 else pos_k[None]
    mask_BQK = pos_k_BK[:, None, :] <= pos_q_BQ[:, :, None]
    if document_ids_q is not None or document_ids_k is not None:
        if document_ids_q is None or document_ids_k is None:
            raise ValueError("causal_document_mask: pass document ids for both queries and keys, or for neither.")
        mask_BQK = mask_BQK & (document_ids_k[:, None, :] == document_ids_q[:, :, None])
    return mask_BQK


def cu_seqlens_from_document_ids(document_ids_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens [num_docs + 1] int32, max_seqlen)`` of the documents of all rows, flattened
    row after row (a document never spans two rows). ``B = 0`` or ``S = 0`` gives ``[0]`` and 0."""
    B, S = document_ids_BS.shape
    if B * S == 0:
        return torch.zeros(1, dtype=torch.int32, device=document_ids_BS.device), 0
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    starts = starts_BS.flatten().nonzero().flatten()
    end = torch.tensor([B * S], device=starts.device, dtype=starts.dtype)
    cu = torch.cat([starts, end]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def resolve_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    packed: bool,
    positioned: bool,
    *,
    head_dim: int | None = None,
    same_tokens: bool = True,
) -> str:
    """The backend ``attend`` runs for a requested one (``auto`` picked here); raises ``ValueError``
    when an explicitly chosen backend cannot run these inputs, naming what to choose instead.
    ``head_dim`` (the larger of the query/key and value ones) decides whether torch's varlen kernel
    can run them (``None``: assume it can). ``same_tokens``: queries and keys are the same tokens
    (one ``[B, S]`` ``document_ids``), which the varlen backends need."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attend: backend={backend!r} is unknown; choose from {list(ATTENTION_BACKENDS)}.")
    if backend == "auto":
        return _auto_backend(device, dtype, packed and same_tokens, positioned, head_dim)
    if backend == "flash_varlen":
        if _flash_varlen_fn() is None:
            raise ValueError(
                "attend: backend='flash_varlen' needs the flash_attn package, which does not import here; "
                "install flash-attn, or choose attention_backend='varlen' (torch's kernel) or 'auto'."
            )
        _check_varlen_inputs("flash_varlen", device, dtype, positioned, same_tokens)
    if backend == "varlen":
        _check_varlen_inputs("varlen", device, dtype, positioned, same_tokens)
        why = _torch_varlen_unavailable_reason(device, head_dim)
        if why is not None:
            raise ValueError(f"attend: backend='varlen' cannot run here: {why}; choose attention_backend='auto'.")
    if backend == "flex" and _flex_fn(device) is None:
        raise ValueError(
            "attend: backend='flex' needs torch.nn.attention.flex_attention, which this torch lacks; "
            "choose attention_backend='sdpa' (or 'auto')."
        )
    return backend


def _auto_backend(
    device: torch.device, dtype: torch.dtype, packed: bool, positioned: bool, head_dim: int | None
) -> str:
    """``auto``: a kernel that skips the work across documents for packed half-precision rows on CUDA."""
    if device.type != "cuda" or not packed or positioned or dtype not in _HALF:
        return "sdpa"
    if _flash_varlen_fn() is not None:
        return "flash_varlen"
    if _torch_varlen_unavailable_reason(device, head_dim) is None:
        return "varlen"
    if _flex_fn(device) is not None:
        return "flex"
    return "sdpa"


def _check_varlen_inputs(
    name: str, device: torch.device, dtype: torch.dtype, positioned: bool, same_tokens: bool
) -> None:
    if device.type != "cuda" or dtype not in _HALF:
        raise ValueError(
            f"attend: backend='{name}' runs on CUDA in float16/bfloat16, not on {device.type} in {dtype}; "
            "choose attention_backend='sdpa' (or 'auto')."
        )
    if positioned:
        raise ValueError(
            f"attend: backend='{name}' orders keys by sequence index and cannot take positions_q/positions_k; "
            "drop the positions or choose attention_backend='sdpa'."
        )
    if not same_tokens:
        raise ValueError(
            f"attend: backend='{name}' needs queries and keys to be the same tokens (one [B, S] document_ids, "
            "as many keys as queries); choose attention_backend='sdpa' or 'flex' for a (queries, keys) pair."
        )


def attend(
    q_BNQD: torch.Tensor,
    k_BNKD: torch.Tensor,
    v_BNKD: torch.Tensor,
    *,
    positions_q: torch.Tensor | None = None,
    positions_k: torch.Tensor | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention ``[B, N, Sq, Dv]`` of ``q [B, N, Sq, D]`` over ``k [B, Nk, Sk, D]``, ``v [B, Nk, Sk, Dv]``.

    ``document_ids``: ``[B, S]`` when queries and keys are the same tokens, or a pair
    ``([B, Sq], [B, Sk])``. ``positions_q``/``positions_k``: ``[S]`` or ``[B, S]`` (both or neither).
    """
    doc_q, doc_k = _split_documents(document_ids)
    masking = _Masking(positions_q, positions_k, doc_q, doc_k)
    _check_inputs(q_BNQD, k_BNKD, v_BNKD, masking)
    packed, positioned = doc_q is not None, positions_q is not None
    same_tokens = not isinstance(document_ids, (tuple, list)) and q_BNQD.shape[2] == k_BNKD.shape[2]
    head_dim = max(q_BNQD.shape[-1], v_BNKD.shape[-1])
    chosen = resolve_backend(
        backend, q_BNQD.device, q_BNQD.dtype, packed, positioned, head_dim=head_dim, same_tokens=same_tokens
    )
    gqa = q_BNQD.shape[1] != k_BNKD.shape[1]
    if chosen == "sdpa":
        if not packed and not positioned:
            return F.scaled_dot_product_attention(q_BNQD, k_BNKD, v_BNKD, is_causal=True, scale=scale, enable_gqa=gqa)
        mask_B1QK = _mask(q_BNQD, k_BNKD, masking)[:, None]
        return F.scaled_dot_product_attention(q_BNQD, k_BNKD, v_BNKD, attn_mask=mask_B1QK, scale=scale, enable_gqa=gqa)
    if chosen == "flex":
        return _attend_flex(q_BNQD, k_BNKD, v_BNKD, masking, scale, gqa)
    if chosen == "varlen":
        return _attend_varlen(q_BNQD, k_BNKD, v_BNKD, doc_q, scale, "varlen", _torch_varlen_kernel)
    return _attend_flash_varlen(q_BNQD, k_BNKD, v_BNKD, doc_q, scale)


# ----------------------------------------------------------------------------------------------


def _split_documents(
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if document_ids is None:
        return None, None
    if isinstance(document_ids, torch.Tensor):
        return document_ids, document_ids
    if isinstance(document_ids, (tuple, list)) and len(document_ids) == 2:
        return document_ids[0], document_ids[1]
    raise TypeError(
        f"attend: document_ids must be a [B, S] tensor or a (queries, keys) pair of them, not {type(document_ids).__name__}."
    )


class _Masking(NamedTuple):
    """What decides which keys a query reads: positions (both or neither) and document ids."""

    pos_q: torch.Tensor | None
    pos_k: torch.Tensor | None
    doc_q: torch.Tensor | None
    doc_k: torch.Tensor | None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masking: _Masking) -> None:
    check_attention_shapes("attend", q, k, v)
    pos_q, pos_k, doc_q, doc_k = masking
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    if (pos_q is None) != (pos_k is None):
        raise ValueError("attend: pass both positions_q and positions_k, or neither.")
    for name, pos, S in (("positions_q", pos_q, Sq), ("positions_k", pos_k, Sk)):
        if pos is not None and (pos.dtype.is_floating_point or pos.shape not in ((S,), (B, S))):
            raise ValueError(f"attend: {name} must be an integer [{S}] or [{B}, {S}] tensor; got {pos.dtype} {tuple(pos.shape)}.")
    for name, doc, S in (("document_ids (queries)", doc_q, Sq), ("document_ids (keys)", doc_k, Sk)):
        if doc is not None and (doc.dtype.is_floating_point or doc.shape != (B, S)):
            raise ValueError(f"attend: {name} must be an integer [{B}, {S}] tensor; got {doc.dtype} {tuple(doc.shape)}.")


def _mask(q: torch.Tensor, k: torch.Tensor, masking: _Masking) -> torch.Tensor:
    pos_q, pos_k, doc_q, doc_k = masking
    if pos_q is None:
        pos_q = torch.arange(q.shape[2], device=q.device)
        pos_k = torch.arange(k.shape[2], device=q.device)
    mask = causal_document_mask(doc_q, doc_k, pos_q, pos_k)
    return mask.expand(q.shape[0], -1, -1)


@functools.cache
def _flash_varlen_fn() -> Callable[..., torch.Tensor] | None:
    try:
        module = importlib.import_module("flash_attn")
    except Exception:  # noqa: BLE001 - a broken install is as unavailable as a missing one
        return None
    return getattr(module, "flash_attn_varlen_func", None)


@functools.cache
def _flex_fn(device: torch.device) -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    if device.type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _attend_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masking: _Masking, scale: float | None, gqa: bool
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    pos_q, pos_k, doc_q, doc_k = masking

    B, N, Sq, _ = q.shape
    Sk = k.shape[2]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type == "cpu" and needs_grad:
        raise ValueError(
            "attend: backend='flex' runs on CPU in forward only (torch's flex_attention has no CPU backward); "
            "choose attention_backend='sdpa' (or 'auto') for training on CPU."
        )
    if q.numel() == 0 or k.numel() == 0:  # nothing to attend; block masks need a non-empty grid
        return q.new_zeros(B, N, Sq, v.shape[-1])
    pq = pos_q if pos_q is not None else torch.arange(Sq, device=q.device)
    pk = pos_k if pos_k is not None else torch.arange(Sk, device=q.device)
    pq_BQ = (pq if pq.dim() == 2 else pq[None]).expand(B, Sq)
    pk_BK = (pk if pk.dim() == 2 else pk[None]).expand(B, Sk)

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex calls it with index tensors
        keep = pk_BK[b, kv_idx] <= pq_BQ[b, q_idx]
        if doc_q is not None:
            keep = keep & (doc_k[b, kv_idx] == doc_q[b, q_idx])
        return keep

    block_mask = create_block_mask(mask_mod, B, None, Sq, Sk, device=q.device)
    with warnings.catch_warnings():  # the CPU path is torch's unfused reference (it says so on every call)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_fn(q.device)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float | None], torch.Tensor]


def _attend_flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    return _attend_varlen(q, k, v, doc, scale, "flash_varlen", _flash_attn_kernel)


def _attend_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: torch.Tensor | None,
    scale: float | None,
    name: str,
    kernel: VarlenKernel,
) -> torch.Tensor:
    """Rows flattened to ``[B*S, heads, D]``, each document one sequence of ``kernel`` (causal)."""
    B, N, S, _ = q.shape
    if k.shape[2] != S:
        raise ValueError(f"attend: backend='{name}' needs as many keys as queries; got {k.shape[2]} and {S}.")
    if doc is None:
        doc = torch.zeros(B, S, dtype=torch.long, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return q.new_zeros(B, N, S, v.shape[-1])
    cu, max_len = cu_seqlens_from_document_ids(doc)

    def flat(x_BNSD: torch.Tensor) -> torch.Tensor:  # [B*S, N, D]: rows one after another
        return x_BNSD.transpose(1, 2).reshape(B * S, x_BNSD.shape[1], x_BNSD.shape[3])

    out_TND = kernel(flat(q), flat(k), flat(v), cu, max_len, scale)
    return out_TND.view(B, S, N, v.shape[-1]).transpose(1, 2)


def _flash_attn_kernel(
    q_TND: torch.Tensor, k_TND: torch.Tensor, v_TND: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    fn = _flash_varlen_fn()
    return fn(q_TND, k_TND, v_TND, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)


# --- torch.nn.attention.varlen ------------------------------------------------------------------


@functools.cache
def _torch_varlen_fn() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _torch_varlen_unavailable_reason(device: torch.device, head_dim: int | None) -> str | None:
    """Why torch's varlen kernel cannot run on ``device`` at ``head_dim``, or ``None`` when it can."""
    fn = _torch_varlen_fn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if _varlen_call_style(fn) is None:
        return "torch.nn.attention.varlen.varlen_attn takes neither is_causal nor window_size"
    if device.type != "cuda":
        return f"it runs on CUDA, not on {device.type}"
    if not _cuda_flash_capable(device):
        need = ".".join(map(str, _VARLEN_MIN_CAPABILITY))
        return f"torch's flash kernel needs a CUDA build with flash attention and compute capability >= {need}"
    if head_dim is not None and (head_dim > _VARLEN_MAX_HEAD_DIM or head_dim % 8):
        return f"head dim {head_dim} is not a multiple of 8 up to {_VARLEN_MAX_HEAD_DIM}"
    return None


@functools.cache
def _cuda_flash_capable(device: torch.device) -> bool:
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(device) >= _VARLEN_MIN_CAPABILITY


@functools.cache
def _varlen_call_style(fn: Callable[..., torch.Tensor]) -> tuple[str, bool] | None:
    """``(how causal is asked for, whether enable_gqa exists)`` for this torch's ``varlen_attn``:
    ``is_causal=True`` in older releases, ``window_size=(-1, 0)`` in newer ones."""
    params = inspect.signature(fn).parameters
    causal = "is_causal" if "is_causal" in params else "window_size" if "window_size" in params else None
    return None if causal is None else (causal, "enable_gqa" in params)


def _torch_varlen_kernel(
    q_TND: torch.Tensor, k_TND: torch.Tensor, v_TND: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    fn = _torch_varlen_fn()
    causal, has_gqa = _varlen_call_style(fn)
    kwargs: dict[str, object] = {"scale": scale}
    kwargs.update({"is_causal": True} if causal == "is_causal" else {"window_size": (-1, 0)})
    groups = q_TND.shape[1] // k_TND.shape[1]
    if groups > 1 and has_gqa:
        kwargs["enable_gqa"] = True
    elif groups > 1:  # this torch's varlen_attn takes as many key/value heads as query heads
        k_TND, v_TND = k_TND.repeat_interleave(groups, dim=1), v_TND.repeat_interleave(groups, dim=1)
    return fn(q_TND, k_TND, v_TND, cu, cu, max_len, max_len, **kwargs)
