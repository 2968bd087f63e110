"""Worker: train a swapped tiny HF Qwen3-MoE under folded_moe, save a DCP checkpoint and logits.

``python worker_hf_export.py OUT_DIR FAMILY TP EP ETP`` on 2 ranks. The test then exports the
checkpoint to HF safetensors in one process and compares the reloaded model's logits.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers the strategy names
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.strategies import FoldedMoEStrategy

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

VOCAB = 64
CONFIGS = {
    "qwen3_moe": {
        "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    },
    "mixtral": {
        "model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}  # fmt: skip


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        w = torch.randint(0, VOCAB, (2, 13), generator=g)
        out.append({"input_ids": w[:, :-1], "labels": w[:, 1:]})
    return out


def main(out: Path, family: str, tp: int, ep: int, etp: int) -> None:
    torch.manual_seed(0)
    lit = HFMoELanguageModel(hf_config=CONFIGS[family], moe={"aux_loss": "switch"}, learning_rate=1e-2, warmup_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=FoldedMoEStrategy(tp=tp, ep=ep, etp=etp, timeout=timedelta(seconds=90)),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(lit, DataLoader(batches(), batch_size=None))
    trainer.save_checkpoint(out / "ckpt")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    lit.eval()
    with torch.no_grad():
        logits = lit(ids)  # every rank runs it: the expert all-to-all needs them all
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    if dist.get_rank() == 0:
        torch.save({"ids": ids, "logits": logits.detach().float()}, out / "logits.pt")
        print("WORKER OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    leave_together()
