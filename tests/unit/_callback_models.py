"""Tiny models, data and Trainers shared by the callback tests (not collected: no ``test_`` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.utils.checkpoint as checkpoint_utils
from torch.utils.data import DataLoader, Dataset

from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import MoETransformer, TransformerConfig

__all__ = ["CheckpointedLM", "RandomTokens", "tiny_config", "tiny_trainer", "token_loader"]

HIDDEN = 32


def tiny_config(num_layers: int = 2, num_experts: int = 4, top_k: int = 2, **moe: Any) -> TransformerConfig:
    """Two MoE blocks, 4 experts, top-2; hidden 32: a training step takes milliseconds."""
    moe_cfg = MoEConfig(
        hidden_size=HIDDEN,
        ffn_hidden_size=32,
        num_experts=num_experts,
        top_k=top_k,
        pre_softmax=True,
        experts_backend="torch",
        **moe,
    )
    return TransformerConfig(
        vocab_size=64, hidden_size=HIDDEN, num_layers=num_layers, num_heads=2, moe=moe_cfg, max_seq_len=32
    )


class RandomTokens(Dataset):
    """Fixed random token windows (seeded, so every run sees the same batches in the same order)."""

    def __init__(self, num: int = 32, seq_len: int = 8, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (num, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def token_loader(num: int = 32, seq_len: int = 8, batch_size: int = 2) -> DataLoader:
    return DataLoader(RandomTokens(num, seq_len), batch_size=batch_size, shuffle=False)


class _CheckpointedTransformer(MoETransformer):
    """Every block wrapped in ``torch.utils.checkpoint`` (its forward re-runs inside backward)."""

    def __init__(self, config: TransformerConfig, use_reentrant: bool) -> None:
        super().__init__(config)
        self.use_reentrant = use_reentrant

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        from lightning_moe.models.transformer import rope_tables

        S = input_ids_BS.shape[1]
        cos_SD, sin_SD = rope_tables(S, self.config.head_dim, self.config.rope_theta, input_ids_BS.device)
        x_BSH = self.embed(input_ids_BS)
        for block in self.layers:
            x_BSH = checkpoint_utils.checkpoint(block, x_BSH, cos_SD, sin_SD, use_reentrant=self.use_reentrant)
        return self.lm_head(self.norm(x_BSH))


class CheckpointedLM(MoELanguageModel):
    """:class:`MoELanguageModel` with activation recompute of every block."""

    def __init__(self, model: TransformerConfig, use_reentrant: bool = False, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.model = _CheckpointedTransformer(model, use_reentrant)


def tiny_trainer(root: Path, callbacks: list[Any], max_steps: int = 3, **kwargs: Any) -> L.Trainer:
    """A quiet one-process CPU Trainer: no validation, no checkpoints, no progress bar."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(root),
    }
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)
