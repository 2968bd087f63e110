"""Worker: Trainer.fit of a tiny HF Qwen3-MoE under context and sequence parallel equals one process.

``python worker_hf_context_fit.py OUT_DIR LAYOUT...`` (``LAYOUT`` like ``cp=2,tp=2,sp=1,ep=2``; ``docs=1``
feeds packed rows: documents crossing the chunk boundaries, positions restarting per document).
Per layout: ``HFMoELanguageModel`` (a dense first layer and an MoE layer with the switch aux loss,
fp32, torch experts) trained ``STEPS`` SGD steps under ``FoldedMoEStrategy`` (FSDP2 on); rank 0
writes ``OUT_DIR/<layout>.pt`` with the loss of every step (the mean over the ranks, which is the
whole batch's), the full gradient of every parameter at the first step and the final parameters.
``reference()`` runs the same model, batches and steps in this process (no strategy).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.moe.utils import set_aux_loss_scale
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.parallel.rank_mean import mean_over_ranks
from lightning_moe.strategies import FoldedMoEStrategy

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

VOCAB, S, BATCH, STEPS, LR = 64, 16, 2, 3, 0.5
HF_CONFIG = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_hidden_layers=2, mlp_only_layers=[0], intermediate_size=48, moe_intermediate_size=16,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)  # fmt: skip
MOE = dict(experts_backend="torch", aux_loss="switch", aux_loss_coeff=0.01)
DOCS = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [3] * 5 + [4] * 11])


class RecordingHF(HFMoELanguageModel):
    """SGD, and the loss of every step and the first step's full gradients recorded."""

    def __init__(self) -> None:
        super().__init__(hf_config=dict(HF_CONFIG), moe=dict(MOE))
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(mean_over_ranks(loss.detach())))
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.grads:
            for name, p in self.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                self.grads[name] = g.detach().cpu().clone()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def batches(docs: bool) -> list[dict[str, torch.Tensor]]:
    from lightning_moe.data.packing import position_ids_from_document_ids

    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, S + 1), generator=gen)
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        if docs:
            batch["document_ids"] = DOCS.clone()
            batch["position_ids"] = position_ids_from_document_ids(DOCS)
        out.append(batch)
    return out


def reference(docs: bool) -> dict[str, Any]:
    """The same model, batches and SGD steps in this process. Lightning gives the training loader
    a shuffling ``DistributedSampler`` (seed 0, epoch 0) over the one data-parallel rank: its order."""
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(0)
    lm = RecordingHF().train()
    opt = torch.optim.SGD(lm.parameters(), lr=LR)
    set_aux_loss_scale(lm.model, 1.0)
    data = batches(docs)
    for index in DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0):
        batch = data[index]
        loss = lm._lm_loss(batch)
        loss.backward()
        lm.losses.append(float(loss.detach()))
        if not lm.grads:
            lm.grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": lm.losses, "grads": lm.grads, "state": {n: p.detach().clone() for n, p in lm.named_parameters()}}


def parse(spec: str) -> tuple[dict[str, Any], bool]:
    layout = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
    docs = bool(layout.pop("docs", 0))
    if layout.pop("sp", 0):
        layout["sequence_parallel"] = True
    return layout, docs


def fit_one(spec: str, out_dir: Path, world: int) -> None:
    layout, docs = parse(spec)
    torch.manual_seed(0)
    model = RecordingHF()
    strategy = FoldedMoEStrategy(**layout, timeout=timedelta(seconds=120))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches(docs), batch_size=None, shuffle=False))
    state = {name: value.cpu() for name, value in gather_full_state(model).items()}
    if dist.get_rank() == 0:
        torch.save({"losses": model.losses, "grads": model.grads, "state": state}, out_dir / f"{spec}.pt")
        print(f"DONE {spec}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    out = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        fit_one(spec, out, int(os.environ["WORLD_SIZE"]))
    leave_together()
