"""bf16 vs FP8 experts: the training loss of the end-to-end model, step by step, on the same data.

The 4-layer Qwen3-30B-A3B-shaped model of ``e2e.py`` (``lightning_moe`` and ``lightning_moe_fp8``),
the same seed and the same batches: windows of the embedded byte corpus (the Python standard
library's source, learnable, unlike random tokens), read in order. The report: both curves, the
mean loss of each 50-step window, the largest relative gap between the two curves' windows after
the first, and the tokens/s of each run (median step).

    python benchmarks/e2e_loss_curve.py                 # 300 steps each (an H200: ~2 minutes)
    python benchmarks/e2e_loss_curve.py --quick         # CPU smoke run
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from e2e import QUICK, Shape, folded_moe_available, run_one, write_report  # noqa: E402

WINDOW = 50


class CorpusWindows(Dataset):
    """Consecutive ``seq_len + 1``-token windows of the embedded corpus, in order."""

    def __init__(self, num: int, seq_len: int) -> None:
        from lightning_moe.data.corpus import load_tokens

        tokens = load_tokens(max_bytes=num * (seq_len + 1) + 1)
        if tokens.numel() < num * (seq_len + 1):
            raise ValueError(f"the embedded corpus holds {tokens.numel()} tokens; {num} windows of {seq_len + 1} need more")
        self.tokens, self.num, self.seq_len = tokens.long(), num, seq_len

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.tokens[i * (self.seq_len + 1) : (i + 1) * (self.seq_len + 1)]
        return {"input_ids": w[:-1], "labels": w[1:]}


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))


def windows(losses: list[float], size: int = WINDOW) -> list[float]:
    return [sum(losses[i : i + size]) / len(losses[i : i + size]) for i in range(0, len(losses), size)]


def compare(bf16: list[float], fp8: list[float], size: int = WINDOW) -> dict[str, Any]:
    """Window means of both curves and the largest relative gap after the first window."""
    wb, wf = windows(bf16, size), windows(fp8, size)
    gaps = [abs(f - b) / abs(b) for b, f in zip(wb, wf)]
    later = gaps[1:] or gaps
    return {"window": size, "bf16_windows": wb, "fp8_windows": wf, "relative_gaps": gaps,
            "max_relative_gap_after_first_window": max(later), "final_window_gap": gaps[-1]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = replace(QUICK if a.quick else Shape(), warmup=0, steps=min(a.steps, 12) if a.quick else a.steps)
    strategy = "folded_moe" if folded_moe_available() else "auto"
    had_pg = dist.is_available() and dist.is_initialized()
    data = CorpusWindows(shape.steps * shape.batch_size, shape.seq_len)
    report: dict[str, Any] = {"shape": shape.__dict__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    curves = {}
    for name in ("lightning_moe", "lightning_moe_fp8"):
        rec = LossRecorder()
        r = run_one(name, shape, device, strategy, dataset=data, callbacks=(rec,))
        curves[name] = rec.losses
        report[name] = {"tokens_per_s": r["tokens_per_s"], "step_ms_median": r["step_ms_median"],
                        "peak_memory_gib": r["peak_memory_gib"], "losses": rec.losses}  # fmt: skip
        print(f"[{name}] {r['tokens_per_s']:,.0f} tokens/s, loss {rec.losses[0]:.4f} -> {rec.losses[-1]:.4f}", flush=True)
    if not had_pg and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # the strategy made one; leave the process as we found it
    cmp = compare(curves["lightning_moe"], curves["lightning_moe_fp8"], WINDOW if not a.quick else 4)
    report["comparison"] = cmp
    report["fp8/bf16 tokens_per_s"] = report["lightning_moe_fp8"]["tokens_per_s"] / report["lightning_moe"]["tokens_per_s"]
    print(f"window means bf16 {[round(v, 4) for v in cmp['bf16_windows']]}", flush=True)
    print(f"window means fp8  {[round(v, 4) for v in cmp['fp8_windows']]}", flush=True)
    print(f"largest relative gap after the first window: {100 * cmp['max_relative_gap_after_first_window']:.3f} % "
          f"(aim <= 1 %); fp8/bf16 tokens/s {report['fp8/bf16 tokens_per_s']:.3f} (aim >= 1.25)", flush=True)  # fmt: skip
    if a.out:
        write_report(a.out, report)
    return report


if __name__ == "__main__":
    main()
