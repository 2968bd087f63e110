"""Worker: the non-finite guard under FoldedMoEStrategy(ep=2) on 2 gloo ranks (FSDP2 + EP DTensors).

``python worker_finite.py``. At step 2, rank 1 alone writes +inf into its local shard of
one expert-weight gradient (after backward, before the guard; clipping is on):

1. ``raise``: every rank raises ``FloatingPointError`` with the same message naming that parameter
   and rank 1, and every rank's local shards equal their values before step 2;
2. ``skip``: with ``FoldedMoEStrategy(skip_nonfinite=1)`` the step is skipped on both ranks and training goes on; each
   rank's final local shards equal those of a run that drops every gradient at step 2;
3. ``fabric``: the same under ``FabricFoldedMoEStrategy(ep=2)``, where ``optimizer.step()`` of the
   optimizer ``fabric.setup`` returned runs the guard: every rank raises the same error naming the
   parameter and rank 1, and no local shard changed.

Rank 0 prints ``RAISE OK <message>``, ``SKIP OK`` and ``FABRIC OK <message>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import BATCH, CLIP, TokenData, leave_together, model_config
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.optimizer import OptimizerConfig
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy

EXPERT_W13 = "model.layers.1.ffn.experts.w13"
BAD_STEP, BAD_RANK, STEPS = 2, 1, 4


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GuardedLM(MoELanguageModel):
    def __init__(self, mode: str) -> None:
        super().__init__(model_config(), optimizer=OptimizerConfig(warmup_steps=1), log_layer_load=False)
        self.mode = mode
        self.before: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before[self.global_step] = {n: _local(p.detach()).clone() for n, p in self.named_parameters()}

    def on_after_backward(self) -> None:
        if self.global_step != BAD_STEP:
            return
        if self.mode == "drop":
            for p in self.parameters():
                p.grad = None
        elif dist.get_rank() == BAD_RANK:
            grad = self.get_parameter(EXPERT_W13).grad
            assert grad is not None and isinstance(grad, DTensor)
            _local(grad)[0, 0, 0] = float("inf")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenData(), batch_size=BATCH, shuffle=False)


def _fit(model: GuardedLM, skip_nonfinite: int = 0) -> GuardedLM:
    strategy = FoldedMoEStrategy(ep=2, skip_nonfinite=skip_nonfinite, timeout=timedelta(seconds=90))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy,
        max_steps=STEPS, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    return model


def _build(mode: str) -> GuardedLM:
    torch.manual_seed(0)
    return GuardedLM(mode)


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def _fabric_raise() -> tuple[str, list[str]]:
    """Fabric steps until ``BAD_STEP``, where rank 1 plants +inf; the error and the changed shards."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricFoldedMoEStrategy(ep=2, timeout=timedelta(seconds=90)))
    fabric.launch()
    torch.manual_seed(0)
    net = MoETransformer(model_config())
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data = TokenData()
    before: dict[str, torch.Tensor] = {}
    try:
        for step in range(STEPS):
            before = {n: _local(p.detach()).clone() for n, p in model.module.named_parameters()}
            ids = torch.stack([data[BATCH * step + i]["input_ids"] for i in range(BATCH)])
            fabric.backward(model(ids).float().logsumexp(-1).mean())
            if step == BAD_STEP and dist.get_rank() == BAD_RANK:
                _local(model.module.get_parameter(EXPERT_W13.removeprefix("model.")).grad)[0, 0, 0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
    except FloatingPointError as err:
        return str(err), _differ(_local_params(model.module), before)
    return "", ["<did not raise>"]


def main() -> None:
    # 1. raise: the same error on every rank, no weight changed
    model, message = _build("inf"), ""
    try:
        _fit(model)
    except FloatingPointError as err:
        message = str(err)
    changed = _differ(_local_params(model), model.before[BAD_STEP]) if message else ["<did not raise>"]
    rank, world = dist.get_rank(), dist.get_world_size()
    results: list[Any] = [None] * world
    dist.all_gather_object(results, (message, changed))
    if rank == 0:
        assert len({m for m, _ in results}) == 1 and message, f"ranks raised different errors or none: {results}"
        assert all(c == [] for _, c in results), f"weights changed before the error: {results}"
        assert f"parameter '{EXPERT_W13}'" in message and f"on rank {BAD_RANK}" in message, message
        print(f"RAISE OK {message}", flush=True)
    # 2. skip, against a run that drops step 2's gradients
    skipped = _local_params(_fit(_build("inf"), skip_nonfinite=1))
    dropped = _local_params(_fit(_build("drop")))
    finite = all(bool(torch.isfinite(t).all()) for t in skipped.values())
    dist.all_gather_object(results, (_differ(skipped, dropped), finite))
    if rank == 0:
        assert all(d == [] and f for d, f in results), f"the skipped run differs from the dropped one: {results}"
        print("SKIP OK", flush=True)
    # 3. Fabric: the guard on the optimizer-step path
    dist.all_gather_object(results, _fabric_raise())
    if rank == 0:
        messages = {m for m, _ in results}
        assert len(messages) == 1 and all(c == [] for _, c in results), f"Fabric ranks disagree or changed: {results}"
        print(f"FABRIC OK {results[0][0]}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    leave_together()
