"""Packed vs padded rows: real tokens per second of the 4-layer e2e model on a length-skewed corpus.

Protocol: the ``lightning_moe`` contender of ``benchmarks/e2e.py`` (its ``Shape``, builder and
training loop: bf16, AdamW, ``folded_moe``) trains on one seeded corpus of documents whose
lengths are drawn log-uniformly between ``--min-len`` and ``seq_len`` tokens, in two arms:

* ``padded`` — one document per row (followed by EOS), padded to ``seq_len``, the loss masked on
  the padding; no document ids, so attention is plain causal (``sdpa``, ``is_causal``);
* ``packed`` — the documents laid end to end into ``seq_len`` rows by ``pack_documents``, with
  ``document_ids`` and ``position_ids``: attention stays inside each document, on the backend
  ``attention_backend`` picks (``auto``: printed; on CUDA without flash_attn, torch's varlen kernel).

Both arms train on every document of the timed corpus, so they see the same real (labelled)
tokens; the padded arm takes more steps. Before the timed steps each arm runs ``--warmup`` steps on
batches of its own from a second corpus of the same distribution. Real tokens/s = labelled tokens
of the timed steps / their summed wall time (device-synchronised, per step, optimizer included).
Also: peak memory (``max_memory_allocated`` over the fit), the fill of each arm's rows, the
attention backend(s) ``attend`` ran, the ratio packed / padded (aim >= 1.5).

    python benchmarks/packed_vs_padded.py                 # Qwen3-30B-A3B block, 4 layers, seq 4096 (one H200)
    python benchmarks/packed_vs_padded.py --quick         # tiny shapes, CPU smoke test
    python benchmarks/packed_vs_padded.py --attention-backend flex --out packed.json
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset


from e2e import QUICK, Shape, build_lightning_moe, folded_moe_available, run_one, write_report  # noqa: E402

from lightning_moe.data.packing import IGNORE_INDEX, pack_documents  # noqa: E402
from lightning_moe.models import attention as attention_module  # noqa: E402
from lightning_moe.models.attention import ATTENTION_BACKENDS  # noqa: E402

__all__ = ["ARMS", "Rows", "corpus", "main", "packed_rows", "padded_rows", "run", "timed_rows", "whole_batches"]

ARMS = ("padded", "packed")
EOS = 1


class Rows(Dataset[dict[str, torch.Tensor]]):
    """The rows of one arm: a dict of ``[R, S]`` tensors, item ``i`` is row ``i``."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows
        self.num = next(iter(rows.values())).shape[0]

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.rows.items()}

    def real_tokens(self) -> torch.Tensor:
        """Labelled tokens of each row: ``[R]``."""
        return (self.rows["labels"] != IGNORE_INDEX).sum(1)


def corpus(num_tokens: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """Documents of log-uniform lengths in ``[min_len, max_len]`` until they hold ``num_tokens``
    tokens; token ids in ``[2, vocab)`` (0 pads, 1 is EOS)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"corpus: need 1 <= min_len <= max_len; got min_len={min_len}, max_len={max_len}.")
    g = torch.Generator().manual_seed(seed)
    docs: list[torch.Tensor] = []
    total = 0
    while total < num_tokens:
        u = float(torch.rand((), generator=g))
        n = int(round(math.exp(math.log(min_len) + u * (math.log(max_len) - math.log(min_len)))))
        docs.append(torch.randint(2, vocab, (n,), generator=g))
        total += n
    return docs


def padded_rows(docs: list[torch.Tensor], seq_len: int) -> Rows:
    """One document per row, padded: ``input_ids`` and ``labels`` only (plain causal attention)."""
    rows = [pack_documents([d], seq_len, EOS, long_documents="truncate") for d in docs]
    return Rows({k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels")})


def packed_rows(docs: list[torch.Tensor], seq_len: int) -> Rows:
    """The documents laid end to end: the four keys of ``pack_documents``."""
    return Rows(pack_documents(docs, seq_len, EOS, long_documents="truncate"))


def whole_batches(rows: Rows, batch_size: int) -> Rows:
    """``rows`` followed by empty rows (padding only, no label) up to a multiple of ``batch_size``."""
    missing = (-rows.num) % batch_size
    if missing == 0:
        return rows
    S = rows.rows["input_ids"].shape[1]
    empty = {
        "input_ids": torch.full((missing, S), EOS, dtype=torch.long),
        "labels": torch.full((missing, S), IGNORE_INDEX, dtype=torch.long),
        "document_ids": torch.zeros(missing, S, dtype=torch.long),
        "position_ids": torch.arange(S).expand(missing, S),
    }
    return Rows({k: torch.cat([v, empty[k]]) for k, v in rows.rows.items()})


def timed_rows(shape: Shape, min_len: int, packed_steps: int, seed: int) -> tuple[Rows, Rows]:
    """``(padded, packed)`` rows of one corpus sized to about ``packed_steps`` packed batches."""
    tokens = int(0.9 * packed_steps * shape.batch_size * shape.seq_len)  # next fit leaves room in rows
    docs = corpus(tokens, min_len, shape.seq_len, shape.vocab, seed)
    padded = whole_batches(padded_rows(docs, shape.seq_len), shape.batch_size)
    packed = whole_batches(packed_rows(docs, shape.seq_len), shape.batch_size)
    return padded, packed


def _warmup_rows(arm: str, shape: Shape, min_len: int, seed: int) -> Rows:
    n = shape.warmup * shape.batch_size
    docs = corpus(2 * n * shape.seq_len, min_len, shape.seq_len, shape.vocab, seed + 1)
    rows = padded_rows(docs, shape.seq_len) if arm == "padded" else packed_rows(docs, shape.seq_len)
    return Rows({k: v[:n] for k, v in rows.rows.items()})


def _concat(a: Rows, b: Rows) -> Rows:
    return Rows({k: torch.cat([a.rows[k], b.rows[k]]) for k in a.rows})


@contextlib.contextmanager
def backends_that_ran() -> Iterator[set[str]]:
    """The backends ``attend`` picked while the block ran (its calls to ``resolve_backend``)."""
    seen: set[str] = set()
    original = attention_module.resolve_backend

    def recording(*args: Any, **kwargs: Any) -> str:
        chosen = original(*args, **kwargs)
        seen.add(chosen)
        return chosen

    attention_module.resolve_backend = recording
    try:
        yield seen
    finally:
        attention_module.resolve_backend = original


def run_arm(arm: str, shape: Shape, timed: Rows, min_len: int, seed: int, device: str, strategy: str,
            attention_backend: str) -> dict[str, Any]:  # fmt: skip
    warm = _warmup_rows(arm, shape, min_len, seed)
    steps = timed.num // shape.batch_size
    arm_shape = replace(shape, steps=steps)
    def builder(s: Shape, dev: str) -> tuple[Any, dict[str, Any]]:
        return build_lightning_moe(s, dev, attention_backend=attention_backend)

    with backends_that_ran() as ran:
        result = run_one("lightning_moe", arm_shape, device, strategy, builder=builder, dataset=_concat(warm, timed))
    real_per_step = timed.real_tokens().view(steps, shape.batch_size).sum(1)
    seconds = [ms / 1e3 for ms in result["step_ms"]]
    real = int(real_per_step.sum())
    result.update({
        "arm": arm, "rows": timed.num, "timed_steps": steps, "real_tokens": real,
        "row_fill": real / (timed.num * shape.seq_len), "real_tokens_per_s": real / sum(seconds),
        "real_tokens_per_s_median_step": float((real_per_step.double() / torch.tensor(seconds)).median()),
        "attention_backend": ",".join(sorted(ran)),
    })  # fmt: skip
    return result


def run(shape: Shape, *, min_len: int, packed_steps: int, seed: int, attention_backend: str,
        arms: tuple[str, ...] = ARMS) -> dict[str, Any]:  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    strategy = "folded_moe" if folded_moe_available() else "auto"
    padded, packed = timed_rows(shape, min_len, packed_steps, seed)
    print(f"device={device}  strategy={strategy}  shape: {asdict(shape)}", flush=True)
    print(f"corpus: {int((padded.real_tokens() > 0).sum())} documents (log-uniform {min_len}..{shape.seq_len} tokens), "
          f"{int(packed.real_tokens().sum()):,} labelled tokens; padded {padded.num} rows, packed {packed.num} rows",
          flush=True)  # fmt: skip
    had_process_group = dist.is_available() and dist.is_initialized()
    results: dict[str, Any] = {}
    for arm in arms:
        timed = padded if arm == "padded" else packed
        results[arm] = run_arm(arm, shape, timed, min_len, seed, device, strategy, attention_backend)
        if not had_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the strategy made one; leave the process as we found it
        r = results[arm]
        peak = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f} GiB"
        print(f"[{arm}] {r['real_tokens_per_s']:,.0f} real tokens/s over {r['timed_steps']} steps  "
              f"fill {100 * r['row_fill']:.1f} %  peak {peak}  attention {r['attention_backend']}", flush=True)  # fmt: skip
    ratio = None
    if all(a in results for a in ARMS):
        ratio = results["packed"]["real_tokens_per_s"] / results["padded"]["real_tokens_per_s"]
        print(f"ratio packed/padded real tokens/s: {ratio:.2f}  (aim >= 1.5)", flush=True)
    return {"benchmark": "packed_vs_padded", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "shape": asdict(shape), "min_len": min_len, "seed": seed, "attention_backend_requested": attention_backend,
            "results": results, "packed_over_padded_real_tokens_per_s": ratio,
            "versions": {"torch": torch.__version__}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm")
    ap.add_argument("--packed-steps", type=int, default=None,
                    help="timed packed batches (the corpus size; the padded arm takes more steps)")  # fmt: skip
    ap.add_argument("--min-len", type=int, default=16, help="shortest document")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    ap.add_argument("--out", "--json", dest="out", default=None, help="JSON path (default: no file)")
    a = ap.parse_args(argv)
    shape = replace(QUICK, warmup=1) if a.quick else Shape(warmup=2)
    overrides = {"seq_len": a.seq_len, "batch_size": a.batch_size, "warmup": a.warmup}
    shape = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    packed_steps = a.packed_steps or (2 if a.quick else 6)
    arms = tuple(s for s in a.arms.split(",") if s)
    if set(arms) - set(ARMS):
        ap.error(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; choose from {ARMS}")
    if a.min_len > shape.seq_len:
        ap.error(f"--min-len={a.min_len} is longer than seq_len={shape.seq_len}; lower it")
    report = run(shape, min_len=a.min_len, packed_steps=packed_steps, seed=a.seed,
                 attention_backend=a.attention_backend, arms=arms)  # fmt: skip
    if a.out:
        write_report(a.out, report)
    return report


if __name__ == "__main__":
    main()
