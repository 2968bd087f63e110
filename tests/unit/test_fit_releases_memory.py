"""A finished ``folded_moe`` fit lets go of the module, its optimizer and its gradients.

Lightning hands every callback the module's ``log`` and ``log_dict`` as bound methods at the
start of a fit and never takes them back, so a callback that outlives the Trainer (a timer in a
benchmark, a monitor reused for the next fit) would keep the module, and through it the Trainer,
its optimizer state and gradients, alive. On CUDA that is device memory that never comes back.
The strategy takes those methods back when the fit ends.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_moe.lit import MoELanguageModel
from lightning_moe.strategies import FoldedMoEStrategy

from _callback_models import tiny_config, tiny_trainer, token_loader


class _KeptCallback(L.Callback):
    """Counts steps; the test keeps it alive after the Trainer is dropped."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.steps += 1


def _fit_and_drop(root: Path, strategy: str) -> tuple[_KeptCallback, weakref.ref, weakref.ref]:
    torch.manual_seed(0)
    # The module first: ``save_hyperparameters`` reads its callers' locals, and on Python < 3.13 that
    # snapshot of this frame (holding whatever was bound at the time) lives until the frame returns.
    module = MoELanguageModel(tiny_config(), learning_rate=1e-3, warmup_steps=1)
    chosen = FoldedMoEStrategy() if strategy == "object" else strategy
    kept = _KeptCallback()
    trainer = tiny_trainer(root, [kept], max_steps=2, strategy=chosen)
    trainer.fit(module, token_loader())
    optimizer = trainer.strategy.optimizers[0]
    optimizer = getattr(optimizer, "optimizer", optimizer)
    refs = weakref.ref(module), weakref.ref(optimizer)
    del trainer, module, optimizer, chosen
    gc.collect()
    return kept, *refs


@pytest.mark.parametrize("strategy", ["folded_moe", "object"])
def test_a_callback_kept_after_the_fit_does_not_keep_the_module_or_its_optimizer(tmp_path: Path, strategy: str) -> None:
    kept, module_ref, optimizer_ref = _fit_and_drop(tmp_path, strategy)
    assert kept.steps == 2
    assert module_ref() is None, "the module outlived its Trainer"
    assert optimizer_ref() is None, "the optimizer outlived its Trainer"
    assert not hasattr(kept, "log") and not hasattr(kept, "log_dict")
