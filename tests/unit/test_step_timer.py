"""StepTimer times whole optimizer steps (every micro-batch of accumulation), after the warm-up."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_moe.callbacks import StepTimer


class _Counting(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.micro_batches = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.micro_batches += 1
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_times_each_optimizer_step_once_after_skipping_the_warmup(capsys: pytest.CaptureFixture[str]) -> None:
    timer = StepTimer(skip_steps=2)
    module = _Counting()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, accumulate_grad_batches=3, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=2))
    assert module.micro_batches == 18 and len(timer.step_ms) == 4  # steps 2..5, one entry per 3 micro-batches
    assert timer.summary["steps_timed"] == 4 and timer.summary["median_ms"] > 0
    assert "over 4 steps" in capsys.readouterr().out


def test_bad_skip_steps_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"skip_steps=-1"):
        StepTimer(skip_steps=-1)
