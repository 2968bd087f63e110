"""StepTimer times whole optimizer steps (every micro-batch of accumulation), after the warm-up."""

from __future__ import annotations

from collections.abc import Callable

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


class _OnCudaUntilTeardown(_Counting):
    """Reports a CUDA device until the strategy's teardown moves it to the CPU (``.cpu()``), as a module
    that trained on one GPU under ``strategy="auto"`` does; its tensors stay on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.trained_on_cuda = True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.trained_on_cuda else torch.device("cpu")

    def cpu(self) -> _OnCudaUntilTeardown:
        self.trained_on_cuda = False
        return super().cpu()


def test_peak_memory_is_read_on_the_device_of_the_fit_after_teardown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning's single-device strategy moves the module to the CPU before ``on_fit_end``; the peak
    is still read from the GPU the module trained on."""
    calls: list[tuple[str, torch.device]] = []

    def record(name: str, value: int = 0) -> Callable[..., int]:
        return lambda device=None: calls.append((name, device)) or value

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset"))
    monkeypatch.setattr(torch.cuda, "synchronize", record("sync"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("allocated", 3 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", record("reserved", 4 * 2**30))
    timer, module = StepTimer(skip_steps=1), _OnCudaUntilTeardown()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="auto", max_steps=3, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2))
    assert not module.trained_on_cuda, "the strategy's teardown did not move the module (the case under test)"
    assert timer.summary["peak_allocated_gib"] == 3.0 and timer.summary["peak_reserved_gib"] == 4.0
    assert "peak memory: 3.00 GiB allocated, 4.00 GiB reserved" in capsys.readouterr().out
    cuda0 = torch.device("cuda", 0)
    assert calls[0] == ("reset", cuda0) and ("allocated", cuda0) in calls and ("sync", cuda0) in calls
