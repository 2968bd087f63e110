"""Long context: the largest sequence the 4-layer e2e model trains at under one memory cap.

Protocol: batch 1, bf16, each trial two training steps (forward, backward, AdamW step; the second
timed: the first allocates the optimizer states) of the 4-layer Qwen3-30B-A3B-shaped model of
``benchmarks/e2e.py`` (its ``Shape``, builders and training loop), in a fresh subprocess per trial
so that an out-of-memory error leaves nothing behind for the next. The process may allocate at
most ``--cap-gib`` of device memory (``torch.cuda.set_per_process_memory_fraction``). Contenders:

* ``lightning_moe`` — our ``MoETransformer`` with ``TransformerConfig(recompute=["block"])``
  (every block rebuilt in backward) and the ``CPUOffload`` callback (``optimizer_states=True``:
  AdamW's moments in host memory; ``--offload-activations`` adds activation patterns);
* ``hf`` — the HF ``Qwen3MoeForCausalLM`` (experts ``grouped_mm``) with its own gradient
  checkpointing on (``gradient_checkpointing_enable``, non-reentrant).

Search per contender, sequence lengths in multiples of ``--granularity``: doubling from
``--start`` until a trial fails or ``--max-seq-len`` is reached, then bisection between the
largest length that trained and the smallest that failed. A trial fails on an out-of-memory error;
any other error (or a trial past ``--trial-timeout-s``) is reported as such and ends the search. ``--time-budget-s`` bounds each
contender's search: no new trial starts after it, and the bracket reached is reported. Reported:
the largest length that trained, tokens/s of its timed step, its peak memory, every trial.

``--quick``: tiny shapes on the CPU, with ``--fake-limit-tokens`` standing in for the memory cap
(a trial above it fails as if out of memory, without building the model).

    python benchmarks/long_context.py --cap-gib 48 --out long.json     # one H200
    python benchmarks/long_context.py --quick                          # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


__all__ = ["CONTENDERS", "SearchResult", "Trial", "main", "search"]

CONTENDERS = ("lightning_moe", "hf")
RESULT_TAG = "LONG_CONTEXT_TRIAL "


@dataclass(frozen=True)
class Trial:
    """One training attempt at ``seq_len``: ``ok``, or why not (``oom`` or another ``error``)."""

    seq_len: int
    ok: bool
    oom: bool = False
    error: str | None = None
    tokens_per_s: float | None = None
    peak_memory_gib: float | None = None
    seconds: float = 0.0


@dataclass
class SearchResult:
    largest_ok: int | None = None
    smallest_failed: int | None = None
    stopped_by_time_budget: bool = False
    trials: list[Trial] = field(default_factory=list)

    def best(self) -> Trial | None:
        """The trial at the largest length that trained."""
        return next((t for t in self.trials if t.ok and t.seq_len == self.largest_ok), None)


def search(
    trial: Callable[[int], Trial],
    start: int,
    granularity: int,
    max_seq_len: int,
    out_of_time: Callable[[], bool] = lambda: False,
) -> SearchResult:
    """Largest multiple of ``granularity`` in ``[start, max_seq_len]`` at which ``trial`` succeeds,
    assuming success is monotone in the length: doubling from ``start``, then bisection."""
    for name, value in (("start", start), ("granularity", granularity), ("max_seq_len", max_seq_len)):
        if value < 1:
            raise ValueError(f"search: {name}={value} must be >= 1.")
    if start % granularity or max_seq_len < start:
        raise ValueError(
            f"search: start={start} must be a multiple of granularity={granularity} and <= max_seq_len={max_seq_len}."
        )
    result = SearchResult()

    def attempt(n: int) -> bool | None:
        if out_of_time():
            result.stopped_by_time_budget = True
            return None
        t = trial(n)
        result.trials.append(t)
        if t.ok:
            result.largest_ok = n
        else:
            result.smallest_failed = n
        return t.ok

    top = max_seq_len // granularity * granularity
    n = start
    while True:
        ok = attempt(n)
        if ok is None or (ok and n >= top):
            return result
        if not ok:
            break
        n = min(2 * n, top)
    lo, hi = result.largest_ok, result.smallest_failed
    if lo is None or result.trials[-1].error is not None:  # the first length failed, or not for memory
        return result
    while hi - lo > granularity:
        mid = lo + (hi - lo) // granularity // 2 * granularity
        ok = attempt(mid)
        if ok is None or result.trials[-1].error is not None:
            break
        lo, hi = (mid, hi) if ok else (lo, mid)
    return result


# --- one trial, in a child process --------------------------------------------------------------


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def run_trial(contender: str, seq_len: int, cap_gib: float, quick: bool, offload_activations: list[str]) -> Trial:
    """Build ``contender`` at ``seq_len``, train two steps under the cap, and measure the second."""
    import torch
    from e2e import QUICK, Shape, build_hf_plain, build_lightning_moe, folded_moe_available, run_one

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    shape = replace(QUICK if quick else Shape(), seq_len=seq_len, batch_size=1, warmup=1, steps=1)
    callbacks: tuple[Any, ...] = ()
    if contender == "lightning_moe":
        from lightning_moe.callbacks import CPUOffload

        callbacks = (CPUOffload(activations=offload_activations, optimizer_states=True),)

        def builder(s: Any, dev: str) -> tuple[Any, dict[str, Any]]:
            return build_lightning_moe(s, dev, recompute=["block"])

        strategy = "folded_moe" if folded_moe_available() else "auto"
    else:

        def builder(s: Any, dev: str) -> tuple[Any, dict[str, Any]]:
            lit, notes = build_hf_plain(s, dev)
            lit.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return lit, {**notes, "gradient_checkpointing": True}

        strategy = "auto"
    t0 = time.perf_counter()
    try:
        r = run_one(contender, shape, device, strategy, builder=builder, callbacks=callbacks)
    except Exception as err:  # noqa: BLE001 - the parent needs the kind of failure, not a traceback
        oom = _is_oom(err)
        return Trial(seq_len, ok=False, oom=oom, error=None if oom else f"{type(err).__name__}: {err}"[:500],
                     seconds=time.perf_counter() - t0)  # fmt: skip
    return Trial(seq_len, ok=True, tokens_per_s=r["tokens_per_s"], peak_memory_gib=r["peak_memory_gib"],
                 seconds=time.perf_counter() - t0)  # fmt: skip


def _trial_main(a: argparse.Namespace) -> None:
    if a.fake_limit_tokens is not None and a.seq_len > a.fake_limit_tokens:
        t = Trial(a.seq_len, ok=False, oom=True, error=None)  # the stand-in for the memory cap
    else:
        t = run_trial(a.contender, a.seq_len, a.cap_gib, a.quick, [p for p in a.offload_activations.split(",") if p])
    print(RESULT_TAG + json.dumps(asdict(t)), flush=True)


# --- the parent ---------------------------------------------------------------------------------


def subprocess_trial(contender: str, a: argparse.Namespace) -> Callable[[int], Trial]:
    """A trial function that runs each length in a fresh ``python long_context.py --trial`` process."""

    def trial(seq_len: int) -> Trial:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trial", "--contender", contender,
               "--seq-len", str(seq_len), "--cap-gib", str(a.cap_gib),
               "--offload-activations", a.offload_activations]  # fmt: skip
        if a.quick:
            cmd.append("--quick")
        if a.fake_limit_tokens is not None:
            cmd += ["--fake-limit-tokens", str(a.fake_limit_tokens)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.trial_timeout_s)
        except subprocess.TimeoutExpired:
            t = Trial(seq_len, ok=False, error=f"timed out after {a.trial_timeout_s} s", seconds=a.trial_timeout_s)
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
            if lines:
                t = Trial(**json.loads(lines[-1][len(RESULT_TAG) :]))
                t = replace(t, seconds=time.perf_counter() - t0)
            else:
                tail = (proc.stderr or proc.stdout)[-800:]
                oom = "out of memory" in tail.lower()
                t = Trial(seq_len, ok=False, oom=oom, error=None if oom else f"exit {proc.returncode}: {tail}",
                          seconds=time.perf_counter() - t0)  # fmt: skip
        status = "ok" if t.ok else "out of memory" if t.oom else f"error: {t.error}"
        speed = f"  {t.tokens_per_s:,.0f} tokens/s  peak {t.peak_memory_gib} GiB" if t.ok else ""
        print(f"[{contender}] seq_len {seq_len}: {status}{speed}  ({t.seconds:.0f} s)", flush=True)
        return t

    return trial


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    contenders = tuple(c for c in a.contenders.split(",") if c)
    results: dict[str, Any] = {}
    for contender in contenders:
        deadline = time.monotonic() + a.time_budget_s
        found = search(subprocess_trial(contender, a), a.start, a.granularity, a.max_seq_len,
                       out_of_time=lambda deadline=deadline: time.monotonic() > deadline)  # fmt: skip
        best = found.best()
        results[contender] = {
            "largest_seq_len": found.largest_ok, "smallest_failed_seq_len": found.smallest_failed,
            "tokens_per_s_at_largest": best.tokens_per_s if best else None,
            "peak_memory_gib_at_largest": best.peak_memory_gib if best else None,
            "stopped_by_time_budget": found.stopped_by_time_budget, "trials": [asdict(t) for t in found.trials],
        }  # fmt: skip
        r = results[contender]
        print(f"[{contender}] largest {r['largest_seq_len']} (first failure {r['smallest_failed_seq_len']}"
              + (", time budget reached" if found.stopped_by_time_budget else "") + ")", flush=True)  # fmt: skip
    ratio = None
    ours, hf = results.get("lightning_moe", {}), results.get("hf", {})
    if ours.get("largest_seq_len") and hf.get("largest_seq_len"):
        ratio = ours["largest_seq_len"] / hf["largest_seq_len"]
        print(f"ratio lightning_moe/hf largest sequence: {ratio:.2f}", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cap = {"cap_gib": a.cap_gib} if a.fake_limit_tokens is None else {"fake_limit_tokens": a.fake_limit_tokens}
    return {"benchmark": "long_context", "device": device, **cap, "start": a.start, "granularity": a.granularity,
            "max_seq_len": a.max_seq_len, "time_budget_s": a.time_budget_s, "quick": a.quick,
            "offload_activations": a.offload_activations, "results": results,
            "lightning_moe_over_hf_largest_seq_len": ratio, "versions": {"torch": torch.__version__}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, --fake-limit-tokens as the cap")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    ap.add_argument("--cap-gib", type=float, default=48.0, help="device memory one trial may allocate")
    ap.add_argument("--start", type=int, default=None, help="first length (default 16384; quick: 32)")
    ap.add_argument("--granularity", type=int, default=None, help="lengths are multiples of this (16384; quick: 32)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="longest length tried (262144; quick: 128)")
    ap.add_argument("--time-budget-s", type=float, default=110.0, help="no new trial of a contender after this")
    ap.add_argument("--trial-timeout-s", type=float, default=240.0, help="a trial running longer fails")
    ap.add_argument("--fake-limit-tokens", type=int, default=None,
                    help="lengths above this fail as if out of memory (quick default: 40)")  # fmt: skip
    ap.add_argument("--offload-activations", default="",
                    help="CPUOffload activation patterns of the lightning_moe contender, comma-separated")  # fmt: skip
    ap.add_argument("--out", "--json", dest="out", default=None, help="JSON path (default: no file)")
    ap.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trial:
        _trial_main(a)
        return None
    defaults = (32, 32, 128) if a.quick else (16384, 16384, 262144)
    a.start = a.start or defaults[0]
    a.granularity = a.granularity or defaults[1]
    a.max_seq_len = a.max_seq_len or defaults[2]
    if a.quick and a.fake_limit_tokens is None:
        a.fake_limit_tokens = 40
    unknown = set(a.contenders.split(",")) - set(CONTENDERS) - {""}
    if unknown:
        ap.error(f"--contenders: unknown {sorted(unknown)}; choose from {CONTENDERS}")
    report = run(a)
    if a.out:
        from e2e import write_report

        write_report(a.out, report)
    return report


if __name__ == "__main__":
    main()
