"""After a ``folded_moe`` fit on CUDA, dropping the Trainer and the module gives the device memory back.

The model holds about 1 GiB of weights, gradients and AdamW state; a callback (like a benchmark's
step timer) outlives the fit. Memory must come back to within 64 MiB of what was allocated before.
"""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_moe import MoEConfig  # noqa: E402
from lightning_moe.lit import MoELanguageModel  # noqa: E402
from lightning_moe.models.transformer import TransformerConfig  # noqa: E402

pytestmark = pytest.mark.gpu


class _Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i, :-1], "labels": self.x[i, 1:]}


class _Timer(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.steps += 1


def _fit(strategy: str, kept: _Timer) -> int:
    moe = MoEConfig(hidden_size=1024, ffn_hidden_size=2048, num_experts=8, top_k=2, pre_softmax=True)
    config = TransformerConfig(vocab_size=4096, hidden_size=1024, num_layers=2, num_heads=8, moe=moe, max_seq_len=256)
    with torch.device("cuda"):
        module = MoELanguageModel(config, learning_rate=1e-4, warmup_steps=1)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[kept])  # fmt: skip
    trainer.fit(module, DataLoader(_Tokens(8, 256, 4096), batch_size=2))
    peak = torch.cuda.max_memory_allocated()
    del trainer, module
    return peak


def test_a_folded_moe_fit_gives_its_device_memory_back() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kept = _Timer()
    peak = _fit("folded_moe", kept)
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - before
    assert kept.steps == 3
    assert peak - before > 512 * 2**20, f"the fit used only {(peak - before) / 2**20:.0f} MiB: too small to prove anything"
    assert left <= 64 * 2**20, f"{left / 2**20:.0f} MiB still allocated after the fit was dropped"
