"""``trainer.predict`` of the LightningModule: the logits one forward gives, packed ids included.

At ``pp = 1`` ``MoELanguageModel.predict_step`` returns ``forward``'s logits ``[B, S, V]`` (the
pipeline's case, and its refusal under context parallel, run in ``tests/dist/test_dist_pipeline_fit.py``).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from _callback_models import tiny_config
from lightning_moe.lit import MoELanguageModel


def _samples(n: int, seq: int, vocab: int, packed: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        item = {"input_ids": torch.randint(0, vocab, (seq,), generator=g)}
        if packed:
            item["document_ids"] = (torch.rand(seq, generator=g) < 0.3).long().cumsum(0)
        out.append(item)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_predict_returns_the_forward_logits_of_each_batch(tmp_path: Path, packed: bool) -> None:
    torch.manual_seed(0)
    lm = MoELanguageModel(tiny_config())
    samples = _samples(5, 12, lm.config.vocab_size, packed)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    outputs = trainer.predict(lm, dataloaders=DataLoader(samples, batch_size=2))
    assert [tuple(o.shape) for o in outputs] == [(2, 12, lm.config.vocab_size)] * 2 + [(1, 12, lm.config.vocab_size)]
    batch = torch.utils.data.default_collate(samples)
    extra = {"document_ids": batch["document_ids"]} if packed else {}
    with torch.no_grad():
        want = lm.eval()(batch["input_ids"], **extra)
    torch.testing.assert_close(torch.cat(outputs), want, rtol=1e-5, atol=1e-5)
