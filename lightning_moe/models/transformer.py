"""A decoder-only MoE transformer: RMSNorm, RoPE attention, MoE FFN blocks.

Legend: B batch, S sequence, H hidden, V vocabulary, N heads, D head dim.

Packed documents: ``forward(input_ids, position_ids=None, document_ids=None)``. With
``document_ids`` (non-decreasing along each row) a token attends only to earlier tokens of its own
document, and positions (for RoPE) restart at each document unless ``position_ids`` are given.
Under context parallelism (``models/context_parallel.py: enable_context_parallel``) the input is this
rank's shard of the sequence and ``position_ids`` are its global positions (required).

The first ``num_dense_layers`` blocks use a dense SwiGLU FFN (as DeepSeek-V3 does); the rest
use :class:`MoELayer`. Attention projections are separate ``q/k/v/o`` Linears so that
tensor parallelism can shard them column/row-wise by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_moe.checks import check_bool, check_float, check_int
from lightning_moe.config import MoEConfig
from lightning_moe.models.attention import ATTENTION_BACKENDS, AttentionBackend, attend
from lightning_moe.models.fp8_dense import DENSE_FP8_CHOICES, DenseFp8, convert_linears_to_fp8
from lightning_moe.models.recompute import RecomputePlan, RecomputeScope, RecomputeTarget, guarded_checkpoint
from lightning_moe.moe.layer import MoELayer
from lightning_moe.ops.qk_norm_rope import qk_norm_rope
from lightning_moe.ops.rope import rope
from lightning_moe.parallel.collectives import all_gather_cat
from lightning_moe.parallel.context import context_parallel_attention, unshard_sequence

__all__ = [
    "TransformerConfig",
    "MoETransformer",
    "Attention",
    "Block",
    "DenseMLP",
    "rope_tables",
    "rope_at_positions",
    "apply_rope",
    "document_positions",
]


@dataclass(kw_only=True)
class TransformerConfig:
    """Model shape. ``moe`` describes every MoE FFN (its hidden size must equal ``hidden_size``).

    ``recompute`` lists what each block rebuilds in backward instead of keeping (fine-grained
    activation recompute; ``models/recompute.py``): ``norm``, ``moe_act``, ``moe``, ``attn``,
    ``block``. ``[]`` keeps everything; ``["moe_act", "norm"]`` is the cheap, memory-heavy choice.

    ``attention_backend`` picks the single-rank attention kernel (``models/attention.py``):
    ``auto``, ``sdpa``, ``flex``, ``flash_varlen`` or ``varlen``.

    ``fp8_dense`` runs the dense layers (attention projections, dense MLPs, shared experts) in FP8
    with the experts' ``moe.fp8`` recipe: ``off``, ``on`` (lightning-moe's FP8 linear) or
    ``torchao`` (torchao's float8 training, CUDA; ``models/fp8_dense.py``).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    moe: MoEConfig
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    num_dense_layers: int = 0
    dense_ffn_hidden_size: int | None = None
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    recompute: list[RecomputeTarget] = field(default_factory=list)
    attention_backend: AttentionBackend = "auto"
    fp8_dense: DenseFp8 = "off"

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from saved hyper-parameters or a plain mapping
            self.moe = MoEConfig(**self.moe)
        if not isinstance(self.moe, MoEConfig):
            raise TypeError(
                f"TransformerConfig: moe={self.moe!r} is not an MoEConfig; pass MoEConfig(...) or a dict of its fields."
            )
        owner = "TransformerConfig"
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_seq_len"):
            check_int(owner, name, getattr(self, name))
        check_int(owner, "num_kv_heads", self.num_kv_heads, optional=True, fix="set a divisor of num_heads, or None")
        check_int(owner, "head_dim", self.head_dim, optional=True, fix="set an even width, or None")
        check_int(owner, "dense_ffn_hidden_size", self.dense_ffn_hidden_size, optional=True)
        check_int(owner, "num_dense_layers", self.num_dense_layers, minimum=0)
        check_float(owner, "rope_theta", self.rope_theta, strict=True, fix="use e.g. 10000.0")
        check_float(owner, "norm_eps", self.norm_eps, strict=True, fix="use e.g. 1e-6")
        check_float(owner, "init_std", self.init_std, strict=True, fix="use e.g. 0.02")
        for name in ("qk_norm", "tie_embeddings"):
            check_bool(owner, name, getattr(self, name))
        RecomputePlan.from_targets(self.recompute)  # raises on a bad list
        if self.fp8_dense not in DENSE_FP8_CHOICES:
            raise ValueError(
                f"TransformerConfig: fp8_dense={self.fp8_dense!r} is unknown; choose one of {DENSE_FP8_CHOICES}."
            )
        if self.fp8_dense != "off" and self.moe.fp8 is None:
            raise ValueError(
                f"TransformerConfig: fp8_dense={self.fp8_dense!r} takes its recipe from moe.fp8, which is None; "
                "set moe.fp8 (e.g. {'recipe': 'blockwise'}) or fp8_dense='off'."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{owner}: attention_backend={self.attention_backend!r} is unknown; choose from {list(ATTENTION_BACKENDS)}."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"TransformerConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; choose num_heads dividing hidden_size, or set head_dim."
                )
            self.head_dim = self.hidden_size // self.num_heads
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(
                f"TransformerConfig: num_heads={self.num_heads} is not divisible by num_kv_heads={kv}; "
                "choose num_kv_heads dividing num_heads."
            )
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"TransformerConfig: moe.hidden_size={self.moe.hidden_size} differs from hidden_size={self.hidden_size}; "
                "set them equal."
            )
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(
                f"TransformerConfig: num_dense_layers={self.num_dense_layers} must be in [0, num_layers={self.num_layers}]."
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig: head_dim={self.head_dim} must be even and >= 2 for RoPE; change head_dim or num_heads."
            )


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[S, D/2]`` in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_at_positions(
    position_ids_BS: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[B, S, D/2]`` at the given positions: row ``position_ids_BS[b, s]`` of
    ``rope_tables`` (the same fp32 products, computed without the table)."""
    device = position_ids_BS.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_BSD = position_ids_BS.to(torch.float32)[..., None] * inv_freq
    return angles_BSD.cos(), angles_BSD.sin()


def document_positions(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where the document id changes along each row ``[B, S]``."""
    B, S = document_ids_BS.shape
    index_BS = torch.arange(S, device=document_ids_BS.device).expand(B, S)
    starts_BS = torch.ones(B, S, dtype=torch.bool, device=document_ids_BS.device)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_index_BS = torch.where(starts_BS, index_BS, torch.zeros_like(index_BS)).cummax(dim=1).values
    return index_BS - start_index_BS


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim. ``cos``/``sin`` are ``[S, D/2]``
    (one table for every row) or ``[B, S, D/2]`` (per-row positions)."""
    if cos_SD.dim() == 3:
        cos_SD, sin_SD = cos_SD[:, None], sin_SD[:, None]  # [B, 1, S, D/2]: broadcast over heads
    x1, x2 = x_BNSD.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos_SD - x2 * sin_SD, x2 * cos_SD + x1 * sin_SD], dim=-1)
    return out.to(x_BNSD.dtype)


class Attention(nn.Module):
    """Causal RoPE attention with grouped kv heads. ``cp_group`` (set by ``enable_context_parallel``)
    makes it attend across the context-parallel group; otherwise ``attend`` runs on this rank with
    ``TransformerConfig.attention_backend``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.backend = cfg.attention_backend
        self.cp_group = None
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3-style per-head RMSNorm of queries and keys (one weight shared by all heads).
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SD: torch.Tensor,
        sin_SD: torch.Tensor,
        document_ids_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_ids_BS`` only matter under context parallelism (global positions, required
        there); on one rank keys are ordered by sequence index, and RoPE comes in ``cos``/``sin``."""
        B, S, _ = x_BSH.shape
        q, k, v = (_heads(proj(x_BSH), self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:  # on [B, S, N, D]: one kernel each on CUDA
            q, k = qk_norm_rope(q, self.q_norm, cos_SD, sin_SD), qk_norm_rope(k, self.k_norm, cos_SD, sin_SD)
        else:
            q, k = rope(q, cos_SD, sin_SD), rope(k, cos_SD, sin_SD)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.cp_group is not None:
            if position_ids_BS is None:
                raise ValueError(
                    "Attention: under context parallelism pass position_ids_BS, the global positions of this rank's "
                    "shard (lightning_moe.parallel.context.cp_chunk_positions)."
                )
            out = context_parallel_attention(q, k, v, position_ids_BS, self.cp_group, document_ids_BS)
        else:
            out = attend(q, k, v, document_ids=document_ids_BS, backend=self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, out.shape[1] * self.head_dim))


def _heads(x_BSX: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, S, N * head_dim]`` as ``[B, S, N, head_dim]``. N comes from the width, not the config:
    under tensor parallelism each rank holds a slice of the heads (and an empty batch has no
    elements for ``view(..., -1, ...)`` to infer N from)."""
    B, S, X = x_BSX.shape
    return x_BSX.view(B, S, X // head_dim, head_dim)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if index < cfg.num_dense_layers:
            dense_ffn = cfg.dense_ffn_hidden_size or 4 * cfg.hidden_size
            self.ffn: nn.Module = DenseMLP(cfg.hidden_size, dense_ffn)
        else:
            self.ffn = MoELayer(cfg.moe, layer_name=f"layers.{index}.ffn")
        self.recompute = RecomputePlan.from_targets(cfg.recompute)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SD: torch.Tensor,
        sin_SD: torch.Tensor,
        document_ids_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # attention gets the extra arguments only when there are any (its call signature is
        # what CUDA-graph capture records)
        extra = () if document_ids_BS is None and position_ids_BS is None else (document_ids_BS, position_ids_BS)
        if self.recompute.block and torch.is_grad_enabled():
            return guarded_checkpoint(self, self._forward, x_BSH, cos_SD, sin_SD, *extra)
        return self._forward(x_BSH, cos_SD, sin_SD, *extra)

    def _forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        with RecomputeScope(self.recompute) as rc:  # plain calls when recompute is empty
            x_BSH = x_BSH + rc.attention(self.attn, rc.norm(self.attn_norm, x_BSH), cos_SD, sin_SD, *extra)
            return x_BSH + rc.ffn(self.ffn, rc.norm(self.ffn_norm, x_BSH))


class MoETransformer(nn.Module):
    """``forward(input_ids[B, S], position_ids[B, S]=None, document_ids[B, S]=None) -> logits[B, S, V]``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope_cache: dict[tuple[int, str, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        convert_linears_to_fp8(self, config.fp8_dense, config.moe.fp8)  # "off": nothing to do

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=std)
            elif "norm" in name:
                nn.init.ones_(p)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]``. ``position_ids_BS`` default to ``0..S-1`` (restarting at each
        document when ``document_ids_BS`` are given); under context parallelism they are the
        shard's global positions and must be given."""
        cp_group = self._cp_group()
        B, S = input_ids_BS.shape
        if cp_group is None and S > self.config.max_seq_len:
            raise ValueError(
                f"MoETransformer: sequence length {S} exceeds max_seq_len={self.config.max_seq_len}; "
                "raise max_seq_len or shorten the batch."
            )
        self._check_ids(input_ids_BS, position_ids_BS, "position_ids_BS")
        self._check_ids(input_ids_BS, document_ids_BS, "document_ids_BS")
        if cp_group is not None and position_ids_BS is None:
            raise ValueError(
                "MoETransformer: under context parallelism the input is this rank's shard; pass position_ids_BS, its "
                "global positions (lightning_moe.parallel.context.cp_chunk_positions, or the documents' positions "
                "sharded the same way)."
            )
        if document_ids_BS is not None or position_ids_BS is not None:
            self._check_packing(position_ids_BS, document_ids_BS, cp_group)
        if document_ids_BS is not None and position_ids_BS is None:
            position_ids_BS = document_positions(document_ids_BS)
        if position_ids_BS is None:
            cos_SD, sin_SD = self._rope_tables(S, input_ids_BS.device)
        else:
            cos_SD, sin_SD = rope_at_positions(position_ids_BS, self.config.head_dim, self.config.rope_theta)
        extra = () if document_ids_BS is None and cp_group is None else (document_ids_BS, position_ids_BS)
        x_BSH = self.embed(input_ids_BS)
        for block in self.layers:
            x_BSH = block(x_BSH, cos_SD, sin_SD, *extra)
        return self.lm_head(self.norm(x_BSH))

    def _cp_group(self):  # noqa: ANN202 - a ProcessGroup or None
        groups = {id(m.cp_group): m.cp_group for m in self.modules() if isinstance(m, Attention)}
        if len(groups) > 1:
            raise ValueError(
                "MoETransformer: its Attention modules have different context-parallel groups; set one group for "
                "the whole model with enable_context_parallel(model, cp_group)."
            )
        return next(iter(groups.values()), None)

    @staticmethod
    def _check_ids(input_ids_BS: torch.Tensor, ids_BS: torch.Tensor | None, name: str) -> None:
        if ids_BS is None:
            return
        if not isinstance(ids_BS, torch.Tensor) or ids_BS.dtype.is_floating_point or ids_BS.dtype == torch.bool:
            raise TypeError(f"MoETransformer: {name} must be an integer tensor, not {getattr(ids_BS, 'dtype', type(ids_BS))}.")
        if ids_BS.shape != input_ids_BS.shape:
            raise ValueError(
                f"MoETransformer: {name} has shape {tuple(ids_BS.shape)}, input_ids_BS {tuple(input_ids_BS.shape)}; "
                "pass one id per token."
            )

    def _check_packing(
        self, position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None, cp_group  # noqa: ANN001
    ) -> None:
        """Document ids must not decrease along a row (each document one contiguous run), and
        positions must lie in ``[0, max_seq_len)``. Under context parallelism the checks run on the
        whole gathered sequence, so every rank of the group raises together (none is left waiting
        in a collective)."""
        ids = [t for t in (position_ids_BS, document_ids_BS) if t is not None]
        stacked_KBS = torch.stack([t.to(torch.long) for t in ids])
        if cp_group is not None:
            world = torch.distributed.get_world_size(cp_group)
            gathered = all_gather_cat(stacked_KBS, cp_group, dim=2)
            stacked_KBS = unshard_sequence(list(gathered.chunk(world, dim=2)), world, dim=2)
        if stacked_KBS.numel() == 0:
            return
        max_len = self.config.max_seq_len
        doc_BS = stacked_KBS[-1] if document_ids_BS is not None else None
        pos_BS = stacked_KBS[0] if position_ids_BS is not None else None
        flags = []
        if doc_BS is not None:
            flags.append((doc_BS[:, 1:] < doc_BS[:, :-1]).any())
        if pos_BS is not None:
            flags.append(((pos_BS < 0) | (pos_BS >= max_len)).any())
        bad = torch.stack(flags).tolist()  # one host sync for every check
        if doc_BS is not None and bad[0]:
            row, col = (doc_BS[:, 1:] < doc_BS[:, :-1]).nonzero()[0].tolist()
            raise ValueError(
                f"MoETransformer: document_ids_BS decrease in row {row} at token {col + 1} "
                f"({int(doc_BS[row, col])} -> {int(doc_BS[row, col + 1])}); packed documents must be contiguous, "
                "with ids non-decreasing along each row."
            )
        if pos_BS is not None and bad[-1]:
            low, high = int(pos_BS.min()), int(pos_BS.max())
            raise ValueError(
                f"MoETransformer: position_ids_BS span [{low}, {high}], outside [0, max_seq_len={max_len}); "
                "raise max_seq_len or fix the positions."
            )

    def _rope_tables(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_tables`` for ``S`` positions, kept per (length, device, inference mode): the tables are
        the same every step, and rebuilding them is eight small launches ahead of the first GEMM."""
        key = (S, str(device), torch.is_inference_mode_enabled())
        tables = self._rope_cache.get(key)
        if tables is None:
            with torch.no_grad():
                tables = rope_tables(S, self.config.head_dim, self.config.rope_theta, device)
            if len(self._rope_cache) >= 8:
                self._rope_cache.clear()
            self._rope_cache[key] = tables
        return tables

    def num_active_params(self) -> int:
        """Parameters one token touches (top-k of the routed experts), excluding embeddings."""
        total = 0
        for name, p in self.named_parameters():
            if name.startswith("embed"):
                continue
            if ".experts." in name:
                moe = self.config.moe
                total += p.numel() * moe.top_k // moe.num_experts
            else:
                total += p.numel()
        return total
