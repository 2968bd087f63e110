"""A decoder-only MoE transformer: RMSNorm, RoPE attention through SDPA, MoE FFN blocks.

Legend: B batch, S sequence, H hidden, V vocabulary, N heads, D head dim.

The first ``num_dense_layers`` blocks use a dense SwiGLU FFN (as DeepSeek-V3 does); the rest
use :class:`MoELayer`. Attention projections are separate ``q/k/v/o`` Linears so that
tensor parallelism can shard them column/row-wise by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_moe.config import MoEConfig, check_bool, check_float, check_int
from lightning_moe.models.recompute import RecomputePlan, RecomputeScope, RecomputeTarget, guarded_checkpoint
from lightning_moe.moe.layer import MoELayer

__all__ = ["TransformerConfig", "MoETransformer", "Attention", "Block", "DenseMLP", "rope_tables", "apply_rope"]


@dataclass(kw_only=True)
class TransformerConfig:
    """Model shape. ``moe`` describes every MoE FFN (its hidden size must equal ``hidden_size``).

    ``recompute`` lists what each block rebuilds in backward instead of keeping (fine-grained
    activation recompute; ``models/recompute.py``): ``norm``, ``moe_act``, ``moe``, ``attn``,
    ``block``. ``[]`` keeps everything; ``["moe_act", "norm"]`` is the cheap, memory-heavy choice.
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


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim."""
    x1, x2 = x_BNSD.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos_SD - x2 * sin_SD, x2 * cos_SD + x1 * sin_SD], dim=-1)
    return out.to(x_BNSD.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
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

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q, k, v = (_heads(proj(x_BSH), self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos_SD, sin_SD), apply_rope(k, cos_SD, sin_SD)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
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

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        if self.recompute.block and torch.is_grad_enabled():
            return guarded_checkpoint(self, self._forward, x_BSH, cos_SD, sin_SD)
        return self._forward(x_BSH, cos_SD, sin_SD)

    def _forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        with RecomputeScope(self.recompute) as rc:  # plain calls when recompute is empty
            x_BSH = x_BSH + rc.attention(self.attn, rc.norm(self.attn_norm, x_BSH), cos_SD, sin_SD)
            return x_BSH + rc.ffn(self.ffn, rc.norm(self.ffn_norm, x_BSH))


class MoETransformer(nn.Module):
    """``forward(input_ids[B, S]) -> logits[B, S, V]``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=std)
            elif "norm" in name:
                nn.init.ones_(p)

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        S = input_ids_BS.shape[1]
        if S > self.config.max_seq_len:
            raise ValueError(
                f"MoETransformer: sequence length {S} exceeds max_seq_len={self.config.max_seq_len}; "
                "raise max_seq_len or shorten the batch."
            )
        cos_SD, sin_SD = rope_tables(S, self.config.head_dim, self.config.rope_theta, input_ids_BS.device)
        x_BSH = self.embed(input_ids_BS)
        for block in self.layers:
            x_BSH = block(x_BSH, cos_SD, sin_SD)
        return self.lm_head(self.norm(x_BSH))

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
