"""Worker: one folded_moe EP2 SGD step of each swapped HF family equals one HF step in one process.

``python worker_hf_families.py FAMILY...`` on 2 gloo ranks (EP2, so DP2: each rank its own
batch). Per family: the swapped model (tiny fp32 config of ``tests/unit/test_hf_families.py``)
is exported back to the plain HF model *before* fitting (bit for bit, tested there); that HF
model takes one SGD step in this process on both ranks' batches together (token mean of the
cross entropy). After ``Trainer.fit`` (one step, same SGD) every rank runs the sharded model on
fixed ids; rank 0 compares its logits with the stepped HF model's and prints
``FAMILY OK <name> <seconds>s``.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers the strategy names
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.hf import export_moe_blocks
from lightning_moe.strategies import FoldedMoEStrategy

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_hf_families import _BASE, CONFIGS, VOCAB  # noqa: E402

LR = 0.5
WORLD = 2
EAGER_ONLY = {"gpt_oss": "eager"}  # attention sinks: transformers has no sdpa path for them


class SGDHFModel(HFMoELanguageModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def batch(rank: int) -> dict[str, torch.Tensor]:
    w = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(100 + rank))
    return {"input_ids": w[:, :-1], "labels": w[:, 1:]}


def reference_logits(hf_model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hf_model.train()
    opt = torch.optim.SGD(hf_model.parameters(), lr=LR)
    batches = [batch(r) for r in range(WORLD)]
    inputs = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    logits = hf_model(input_ids=inputs, use_cache=False).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    opt.step()
    hf_model.eval()
    with torch.no_grad():
        return hf_model(input_ids=ids, use_cache=False).logits


def run(name: str) -> None:
    start = time.perf_counter()
    model_type, kwargs, _ = CONFIGS[name]
    torch.manual_seed(0)
    lit = SGDHFModel(
        hf_config={"model_type": model_type, **_BASE, **kwargs},
        moe={"experts_backend": "torch", "bias_update_rate": 0.0}, warmup_steps=0,
        attn_implementation=EAGER_ONLY.get(model_type, "sdpa"),
    )  # fmt: skip
    biases = torch.Generator().manual_seed(3)  # the same on every rank
    with torch.no_grad():
        for tensor_name, t in [*lit.model.named_buffers(), *lit.model.named_parameters()]:
            if tensor_name.endswith("expert_bias"):
                t.copy_(torch.linspace(-0.05, 0.05, t.numel()))  # non-zero: steers the selection
            elif tensor_name.endswith(("router.bias", "experts.b13", "experts.b2")):  # gpt-oss: zero-initialised
                t.copy_(torch.randn(t.shape, generator=biases) * 0.05)
    hf_model = export_moe_blocks(copy.deepcopy(lit.model))
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=FoldedMoEStrategy(ep=2, timeout=timedelta(seconds=120)),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    rank = int(os.environ["RANK"])
    trainer.fit(lit, DataLoader([batch(rank)], batch_size=None))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    lit.eval()
    with torch.no_grad():
        got = lit(ids)  # every rank runs it: the expert all-to-all needs them all
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    if dist.get_rank() == 0:
        want = reference_logits(hf_model, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        print(f"FAMILY OK {name} {time.perf_counter() - start:.1f}s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    for family in sys.argv[1:]:
        run(family)
    leave_together()
