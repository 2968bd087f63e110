"""Worker: the non-finite guard at W=2 PP2 (1f1b): a stage's bad gradient stops the step on both stages.

``python worker_pipeline_guard.py``. At step 1, rank 1 (the last stage: blocks 2-3, norm, head)
writes +inf into its local shard of one of its gradients after the pipeline's backward, before
the guard. Both ranks must raise ``FloatingPointError`` with the same message, naming that
parameter (which rank 0 does not hold) and rank 1, and neither rank's parameters may change in
that step. Rank 0 prints ``PIPELINE GUARD OK <message>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lightning_moe  # noqa: F401 - registers "folded_moe"
from _models import CLIP, leave_together
from _pipeline_models import PipelineLM
from lightning_moe.strategies import FoldedMoEStrategy

BAD = "model.layers.3.attn.o_proj.weight"
BAD_STEP, BAD_RANK = 1, 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GuardedLM(PipelineLM):
    def __init__(self) -> None:
        super().__init__()
        self.before: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before[self.global_step] = {n: _local(p.detach()).clone() for n, p in self.named_parameters()}

    def on_after_backward(self) -> None:
        if self.global_step == BAD_STEP and dist.get_rank() == BAD_RANK:
            grad = self.get_parameter(BAD).grad
            _local(grad).view(-1)[0] = float("inf")


def main() -> None:
    torch.manual_seed(0)
    model = GuardedLM()
    strategy = FoldedMoEStrategy(pp=2, pp_microbatches=4, timeout=timedelta(seconds=90))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    try:
        trainer.fit(model)
    except FloatingPointError as error:
        message = str(error)
    else:
        raise AssertionError("the guard did not stop the step with an inf gradient")
    messages: list[Any] = [None, None]
    dist.all_gather_object(messages, message)
    if messages[0] != messages[1]:
        raise AssertionError(f"the ranks raised different messages: {messages}")
    if "layers.3.attn.o_proj.weight" not in message or "rank 1" not in message:
        raise AssertionError(f"the message names the wrong parameter or rank: {message}")
    after = {n: _local(p.detach()) for n, p in model.named_parameters()}
    changed = [n for n, want in model.before[BAD_STEP].items() if not torch.equal(after[n], want)]
    if changed:
        raise AssertionError(f"rank {dist.get_rank()}: {changed[:3]} changed in the stopped step")
    if dist.get_rank() == 0:
        print(f"PIPELINE GUARD OK {message}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    leave_together()
