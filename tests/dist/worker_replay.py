"""Worker: RouterReplay under FoldedMoEStrategy on 4 gloo ranks, record then replay.

``python worker_replay.py OUT_DIR SPEC...``, SPEC like ``ep=2`` or ``ep=4+recompute``; all SPECs run
in this one torchrun job (one start-up). Every rank records
its own shard; the replay run starts from the same weights with the routers perturbed (so free
routing would differ) and must route exactly the recorded ids in every forward — including the
recomputed forward of every block when ``recompute`` wraps the blocks in
``torch.utils.checkpoint`` — while the routers still receive non-zero gradients. Each rank
prints ``OK <SPEC> rank <r> forwards=<n>``.
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
import torch.utils.checkpoint as checkpoint_utils
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

import lightning_moe  # noqa: F401 - registers "folded_moe"
import _models  # noqa: E402 - tests/dist is on sys.path for workers
from lightning_moe.callbacks import RouterReplay
from lightning_moe.callbacks.router_replay import load_shard
from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import (
    MoETransformer,
    TransformerConfig,
    rope_tables,
)
from lightning_moe.moe.utils import find_moe_layers
from lightning_moe.strategies import FoldedMoEStrategy

VOCAB, SEQ, BATCH, ACCUM, STEPS = 64, 8, 2, 2, 3
Key = tuple[int, int]


def token_data() -> Dataset:
    return _models.TokenData(num_samples=4 * BATCH * ACCUM * STEPS, seq=SEQ, seed=3000, vocab=VOCAB)


class RecomputedTransformer(MoETransformer):
    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        cos_SD, sin_SD = rope_tables(
            input_ids_BS.shape[1], self.config.head_dim, self.config.rope_theta, input_ids_BS.device
        )
        x_BSH = self.embed(input_ids_BS)
        for block in self.layers:
            x_BSH = checkpoint_utils.checkpoint(block, x_BSH, cos_SD, sin_SD, use_reentrant=False)
        return self.lm_head(self.norm(x_BSH))


class LM(MoELanguageModel):
    def __init__(self, recompute: bool) -> None:
        moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, pre_softmax=True)
        cfg = TransformerConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, moe=moe, max_seq_len=SEQ)
        super().__init__(cfg, log_layer_load=False, warmup_steps=1)
        if recompute:
            self.model = RecomputedTransformer(cfg)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=BATCH, shuffle=False)


class Spy(pl.Callback):
    """Ids of every router forward per (step, micro-batch); router gradient norms per step."""

    def __init__(self) -> None:
        self.ids: dict[Key, dict[str, list[torch.Tensor]]] = {}
        self.grad_norms: list[float] = []
        self._key: Key | None = None
        self._layers: list[tuple[str, Any]] = []

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self._layers = find_moe_layers(pl_module)
        for name, layer in self._layers:
            layer.router.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.ids.setdefault(self._key, {}).setdefault(name, []).append(output.routed_ids_TK.clone())  # type: ignore[arg-type]

        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        step = trainer.global_step
        self._key = (step, 0) if self._key is None or self._key[0] != step else (step, self._key[1] + 1)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        for _, layer in self._layers:
            grad = layer.router.weight.grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            self.grad_norms.append(float(grad.norm()))


def fit(spec: dict[str, int], recompute: bool, callbacks: list[Any], perturb: bool) -> None:
    torch.manual_seed(0)
    model = LM(recompute)
    if perturb:
        g = torch.Generator().manual_seed(7)
        for _, layer in find_moe_layers(model):
            w = layer.router.weight
            w.data += torch.randn(w.shape, generator=g) * 10 * w.data.std()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        strategy=FoldedMoEStrategy(**spec, timeout=timedelta(seconds=90)), max_steps=STEPS,
        accumulate_grad_batches=ACCUM, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model)


def main(out: Path, spec_text: str, recompute: bool) -> None:
    spec = {k: int(v) for k, v in (item.split("=") for item in spec_text.split(","))}
    routes = out / spec_text.replace(",", "_")
    fit(spec, recompute, [RouterReplay("record", str(routes)), Spy()], perturb=False)
    rank = dist.get_rank()
    recorded: dict[Key, dict[str, torch.Tensor]] = {}
    for file in sorted(routes.glob(f"rank{rank:05d}-step*.pt")):
        recorded.update(load_shard(file)["steps"])
    assert sorted(recorded) == [(s, m) for s in range(STEPS) for m in range(ACCUM)], sorted(recorded)

    spy = Spy()
    fit(spec, recompute, [RouterReplay("replay", str(routes)), spy], perturb=True)
    forwards = 0
    for key, layers in recorded.items():
        for name, ids in layers.items():
            seen = spy.ids[key][name]
            assert len(seen) == (2 if recompute else 1), (key, name, len(seen))
            for s in seen:
                assert torch.equal(s, ids.long()), (rank, key, name)
            forwards += len(seen)
    assert len(spy.grad_norms) == 2 * STEPS and all(n > 0 for n in spy.grad_norms), spy.grad_norms
    print(f"OK {spec_text} rank {rank} forwards={forwards}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for arg in sys.argv[2:]:
        spec_text, _, flag = arg.partition("+")
        main(Path(sys.argv[1]), spec_text, flag == "recompute")
    _models.leave_together()
