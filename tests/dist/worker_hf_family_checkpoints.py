"""Worker: HF checkpoints of several families load sharded on 2 folded_moe ranks and stream back out.

``python worker_hf_family_checkpoints.py ROOT NAME:LAYOUT...`` on 2 gloo ranks (``LAYOUT``: e.g.
``ep=2`` or ``tp=2``; ``ROOT/NAME`` holds the checkpoint the test saved with ``save_pretrained``).
Per entry: ``HFMoELanguageModel(load_sharded=True)`` under ``FoldedMoEStrategy`` (each rank reads
only its slices); rank 0 compares its logits with the one-process ``from_pretrained`` model's
(fp32, 1e-5); every rank streams its part out (``stream_export_hf``) and rank 0 checks that the
export holds the input checkpoint's tensors bit for bit, written by both ranks, and that
``from_pretrained`` loads it to the same logits. Rank 0 prints ``CKPT OK <name>:<layout> <seconds>s``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers the strategy names
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.strategies import FoldedMoEStrategy

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_hf_family_checkpoints import attention  # noqa: E402


def _layout(spec: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in spec.split("+"))}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint

    return HFCheckpoint(path).read_all()


def run(root: Path, entry: str) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint
    from lightning_moe.checkpoint.hf_stream_export import stream_export_hf

    start = time.perf_counter()
    name, spec = entry.split(":")
    hf = root / name
    lit = HFMoELanguageModel(pretrained=str(hf), load_sharded=True, dtype="float32", moe={"experts_backend": "torch"},
                             attn_implementation=attention(name))  # fmt: skip
    vocab = lit.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(7))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=FoldedMoEStrategy(**_layout(spec), timeout=timedelta(seconds=120)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1,
    )  # fmt: skip
    trainer.validate(lit, DataLoader([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], batch_size=None))
    lit.eval()
    assert not any(p.is_meta for p in lit.parameters())
    assert any(isinstance(p, DTensor) for p in lit.parameters()), entry  # the layout sharded something
    with torch.no_grad():
        got = lit(ids)  # every rank runs it: the expert all-to-all needs them all
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    export = root / f"export_{name}_{spec.replace('=', '').replace('+', '_')}"
    stream_export_hf(lit.model, export, group=dist.group.WORLD, max_shard_bytes=20_000)
    if dist.get_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{entry}: {m}")
        a, b = _tensors(hf), _tensors(export)
        assert sorted(a) == sorted(b), (entry, set(a) ^ set(b))
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (entry, key)
        writers = {f.split("-")[1] for f in set(HFCheckpoint(export).weight_map.values())}
        assert len(writers) == 2, (entry, writers)  # both ranks wrote files of their own
        again = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).float().eval()
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=0)
        print(f"CKPT OK {entry} {time.perf_counter() - start:.1f}s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    for item in sys.argv[2:]:
        run(Path(sys.argv[1]), item)
    leave_together()
