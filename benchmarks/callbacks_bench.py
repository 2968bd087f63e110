"""Memory and launch-overhead features, each arm beside its baseline in one run (one GPU).

    python benchmarks/callbacks_bench.py                  # the H200 protocol below
    python benchmarks/callbacks_bench.py --quick          # tiny shapes; runs on CPU as a smoke test
    python benchmarks/callbacks_bench.py --arms graphs --out graphs.json
    python benchmarks/callbacks_bench.py --arms recompute --batch 16 --recompute moe_act,norm,attn
    python benchmarks/callbacks_bench.py --arms offload --offload '*layers.*.ffn'

Model: the 4-layer Qwen3-30B-A3B-shaped transformer of ``e2e.py`` (hidden 2048, 32 heads with
4 KV heads, 128 experts, top-8, expert FFN 768, vocabulary 151936), bf16 parameters, AdamW.
Plain torch loops (model + AdamW), same seed and batches in every arm. The LM head and loss run
in token chunks under checkpoint in every arm (``ChunkedLM``), so [T, V] logits do not swamp the
blocks' activations, which is what these features act on.

Arms (baseline: no feature, same shapes):

* ``recompute`` — ``TransformerConfig(recompute=["moe_act", "norm"])`` at micro-batch
  ``--batch`` x ``--seq`` (8 x 4096 = 32768 tokens: the activations, not the fixed gradient
  transients of the expert weights, dominate the peak). Aim: activation peak -30 %, step time +10 % at most.
* ``offload`` — ``CPUOffload()`` (activations of every block child, the 2 modules ahead prefetched in backward).
  Aim: activation peak -40 %, step time +15 % at most, losses equal (see below).
* ``optimizer`` — ``CPUOffload(activations=[], optimizer_states=True)``. Aim: device memory
  after the step lower by >= 2x the parameter bytes (AdamW's two states), losses equal.
* ``graphs`` — ``CUDAGraphCapture(warmup_steps=3)`` on the launch-bound shape: micro-batch
  1 x 512, ``capacity_factor=1.25, pad_to_capacity=True`` (static shapes) in both arms, 20 steps.
  Aim: step time 1.3x faster, losses over the 20 steps identical.

Measurements: "activation peak" is ``max_memory_allocated`` during forward + backward minus the
allocation before the step, with gradients kept allocated (``zero_grad(set_to_none=False)``), so
parameters, gradients and optimizer states are not counted; "saved at end of forward" is the
allocation after the loss minus the same baseline. Step time is the median wall time of a whole
step (forward, backward, optimizer) over the timed steps, synchronized. The table comes last.

Losses: the baseline is not bitwise reproducible run to run on a GPU in bf16 (FlashAttention's
backward and atomics), so it runs twice on the same batches and seeds (the second run for its
losses only). The noise floor is max |loss_a - loss_b| over the steps of the two baseline runs;
each memory arm reports max |loss - baseline loss| beside it: "bitwise" when the losses are
identical, "MET (within run-to-run noise)" when the difference is at most the floor, else
"NOT MET". Deterministic algorithms are not switched on: this measures the default setup.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


from lightning_moe.callbacks._optimizer_states import OptimizerStateOffloader  # noqa: E402
from lightning_moe.callbacks._patterns import select_modules  # noqa: E402
from lightning_moe.callbacks.cuda_graphs import CUDAGraphCapture  # noqa: E402
from lightning_moe.callbacks.offload import DEFAULT_ACTIVATIONS, ActivationOffloader, CPUOffload  # noqa: E402
from lightning_moe.config import MoEConfig  # noqa: E402
from lightning_moe.models.transformer import MoETransformer, TransformerConfig  # noqa: E402

__all__ = ["ChunkedLM", "main"]

ARMS = ("recompute", "offload", "optimizer", "graphs")


class ChunkedLM(nn.Module):
    """The transformer, its LM head and loss applied ``chunk`` tokens at a time under checkpoint."""

    def __init__(self, config: TransformerConfig, chunk: int) -> None:
        super().__init__()
        self.body = MoETransformer(config)
        self.head = self.body.lm_head
        self.body.lm_head = nn.Identity()
        self.chunk = chunk

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        h_TH = self.body(ids_BS).flatten(0, 1)
        y_T = labels_BS.flatten()
        total = h_TH.new_zeros((), dtype=torch.float32)
        for i in range(0, h_TH.shape[0], self.chunk):
            part = slice(i, i + self.chunk)
            total = total + checkpoint(_ce_sum, h_TH[part], self.head.weight, y_T[part], use_reentrant=False)
        return total / y_T.numel()


def _ce_sum(h_TH: torch.Tensor, w_VH: torch.Tensor, y_T: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h_TH, w_VH).float(), y_T, reduction="sum")


@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    ffn: int
    layers: int
    vocab: int
    batch: int
    seq: int
    graph_seq: int
    chunk: int


FULL = Shape(hidden=2048, heads=32, kv_heads=4, experts=128, top_k=8, ffn=768, layers=4, vocab=151936,
             batch=8, seq=4096, graph_seq=512, chunk=256)  # fmt: skip
QUICK = Shape(hidden=64, heads=4, kv_heads=2, experts=8, top_k=2, ffn=32, layers=2, vocab=256,
              batch=2, seq=64, graph_seq=32, chunk=32)  # fmt: skip


def model_config(s: Shape, seq: int, recompute: list[str] | None = None, static: bool = False) -> TransformerConfig:
    moe = MoEConfig(
        hidden_size=s.hidden,
        ffn_hidden_size=s.ffn,
        num_experts=s.experts,
        top_k=s.top_k,
        capacity_factor=1.25 if static else None,
        pad_to_capacity=static,
    )
    return TransformerConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_layers=s.layers,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        moe=moe,
        max_seq_len=seq,
        recompute=list(recompute or []),  # type: ignore[arg-type]
    )


@dataclass
class Run:
    """What one training loop measured."""

    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    act_peak_gib: list[float] = field(default_factory=list)
    saved_gib: list[float] = field(default_factory=list)
    fwd_bwd_ms: list[float] = field(default_factory=list)  # forward + backward, without the optimizer
    after_step_gib: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)

    def median(self, key: str, skip: int) -> float:
        values = getattr(self, key)[skip:]
        return statistics.median(values) if values else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: float) -> float:
    return n / 2**30


def _batches(
    s: Shape, batch: int, seq: int, steps: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, s.vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def build(cfg: TransformerConfig, s: Shape, device: torch.device, dtype: torch.dtype) -> ChunkedLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = ChunkedLM(cfg, s.chunk)
    return model.to(dtype)


def train(
    name: str,
    model: ChunkedLM,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    set_to_none: bool,
    setup: Callable[[ChunkedLM, torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[], None] | None = None,
    fused: bool = False,
) -> Run:
    """One plain loop: forward, backward, AdamW step (``fused``: one kernel); memory and time per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {}))
    attached = setup(model, opt) if setup is not None else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run = Run(name)
    cuda = device.type == "cuda"
    for ids, labels in batches:
        if before_step is not None:
            before_step()
        _sync(device)
        start = time.perf_counter()
        if cuda:
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss = model(ids, labels)
        if cuda:
            run.saved_gib.append(_gib(torch.cuda.memory_allocated(device) - base))
        loss.backward()
        if cuda:
            run.act_peak_gib.append(_gib(torch.cuda.max_memory_allocated(device) - base))
        _sync(device)
        run.fwd_bwd_ms.append((time.perf_counter() - start) * 1e3)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        _sync(device)
        run.step_ms.append((time.perf_counter() - start) * 1e3)
        run.losses.append(float(loss.detach()))
    if cuda:  # blocks freed behind side-stream copies are released once their events are processed
        torch.cuda.empty_cache()
        run.after_step_gib = _gib(torch.cuda.memory_allocated(device))
    if isinstance(attached, _Attached):
        run.extra.update(attached.stats())
        attached.detach()
    return run


def _free(*objs: Any) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _offload_setup(
    device: torch.device,
    activations: bool,
    optimizer_states: bool,
    patterns: list[str] | None = None,
    max_gib: float | None = None,
    prefetch: int = 2,
) -> Callable[..., Any]:
    """CUDA: the CPUOffload callback's plain-loop API. CPU: its engines, copying host to host."""

    def setup(model: ChunkedLM, opt: torch.optim.Optimizer) -> _Attached:
        if device.type == "cuda":
            cb = CPUOffload(
                activations=patterns if activations else [], optimizer_states=optimizer_states, max_offload_gib=max_gib,
                prefetch=prefetch,
            )
            cb.attach(model, device, optimizers=[opt])
            engines = [cb.activation_offloader, *cb.optimizer_offloaders]
            return _Attached([e for e in engines if e is not None], cb.detach)
        engines: list[Any] = []
        if activations:
            selected = select_modules("bench", model, patterns or list(DEFAULT_ACTIVATIONS), "activations")
            budget = None if max_gib is None else int(max_gib * 2**30)
            engines.append(
                ActivationOffloader(selected, device, prefetch, min_tensor_bytes=0, max_bytes_per_step=budget)
            )
        if optimizer_states:
            engines.append(OptimizerStateOffloader(opt, device, min_tensor_bytes=64))
        for e in engines:
            e.attach()
        return _Attached(engines, lambda: [e.detach() for e in engines])

    return setup


class _Attached:
    """Engines attached for one run: their statistics, and how to detach them."""

    def __init__(self, engines: list[Any], detach: Callable[[], Any]) -> None:
        self.engines = engines
        self.detach = detach

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.engines:
            if isinstance(e, ActivationOffloader):
                out["offloaded_gib_per_step"] = _gib(e.offloaded_bytes)
            if isinstance(e, OptimizerStateOffloader):
                out["optimizer_state_gib_on_device"] = _gib(e.state_bytes_on_device())
        return out


# ----------------------------------------------------------------------------------------------


def bench_memory_arms(
    s: Shape,
    arms: list[str],
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
    warmup: int,
    recompute: list[str],
    patterns: list[str] | None,
    max_gib: float | None = None,
    prefetch: int = 2,
) -> dict[str, Any]:
    batches = _batches(s, s.batch, s.seq, steps, device)
    runs: dict[str, Run] = {}

    def go(name: str, targets: list[str] | None = None, **offload: bool) -> None:
        model = build(model_config(s, s.seq, targets), s, device, dtype)
        setup = _offload_setup(device, patterns=patterns, max_gib=max_gib, prefetch=prefetch, **offload) if offload else None  # type: ignore[arg-type]
        runs[name] = train(name, model, batches, device, set_to_none=False, setup=setup)
        if name == "optimizer":
            runs[name].extra["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        _report(runs[name], warmup)
        _free(model)

    go("baseline")
    rerun = baseline_rerun(s, device, dtype, batches)
    floor = max_abs_diff(runs["baseline"].losses, rerun)
    print(f"{'baseline-rerun':>16}: losses {[f'{x:.4f}' for x in rerun[:3]]} | noise floor max |diff| {floor:.3e}",
          flush=True)  # fmt: skip
    runs["baseline"].extra["rerun_losses"] = rerun
    if "recompute" in arms:
        go("recompute", recompute)
    if "offload" in arms:
        go("offload", activations=True, optimizer_states=False)
    if "optimizer" in arms:
        go("optimizer", activations=False, optimizer_states=True)
    return {name: asdict(run) for name, run in runs.items()}


def baseline_rerun(
    s: Shape, device: torch.device, dtype: torch.dtype, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """The baseline again on the same batches and seeds: its losses, for the run-to-run noise floor."""
    model = build(model_config(s, s.seq), s, device, dtype)
    losses = train("baseline-rerun", model, batches, device, set_to_none=False).losses
    _free(model)
    return losses


def bench_graphs(s: Shape, device: torch.device, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    if device.type != "cuda":
        print("graphs: skipped, CUDA graphs need a CUDA device", flush=True)
        return {"skipped": "needs CUDA"}
    batches = _batches(s, 1, s.graph_seq, steps, device)
    cfg = model_config(s, s.graph_seq, static=True)
    out: dict[str, Any] = {}
    model = build(cfg, s, device, dtype)
    # Fused AdamW in both arms: the launch-bound loop a user tuning launches would run.
    out["eager"] = asdict(train("graphs-eager", model, batches, device, set_to_none=True, fused=True))
    _free(model)
    model = build(cfg, s, device, dtype)
    cb = CUDAGraphCapture(warmup_steps=3)
    cb.attach(model, device, precision="bf16-true")
    run = train("graphs-captured", model, batches, device, set_to_none=True, before_step=cb.step, fused=True)
    cb.detach()
    run.extra["captured"] = cb.last_captured
    run.extra["replays"] = cb.replays
    out["graphed"] = asdict(run)
    _free(model)
    return out


def _report(run: Run, warmup: int) -> None:
    peak = run.median("act_peak_gib", warmup)
    print(
        f"{run.name:>16}: step {run.median('step_ms', warmup):8.1f} ms | activation peak {peak:6.2f} GiB | "
        f"saved at end of forward {run.median('saved_gib', warmup):6.2f} GiB | after step {run.after_step_gib:6.2f} GiB"
        f" | losses {['%.4f' % x for x in run.losses[:3]]} {run.extra or ''}",
        flush=True,
    )


# ----------------------------------------------------------------------------------------------


def _pct(new: float, old: float) -> float:
    return (new / old - 1.0) * 100.0 if old == old and old else float("nan")


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "NOT MET")


def _known(x: float) -> bool:
    return x == x  # not NaN (CPU runs have no device memory figures)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """max |a_i - b_i| over the steps; inf when the runs differ in length, NaN when a loss is NaN."""
    if len(a) != len(b):
        return float("inf")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return float("nan") if not all(_known(d) for d in diffs) else max(diffs, default=0.0)


def loss_verdict(losses: list[float], base: list[float], floor: float) -> str:
    """"bitwise" when identical, "MET (within run-to-run noise)" when max |diff| <= floor, else "NOT MET"."""
    if losses == base:
        return "bitwise"
    return "MET (within run-to-run noise)" if max_abs_diff(losses, base) <= floor else "NOT MET"


def loss_noise(mem: dict[str, Any]) -> dict[str, Any]:
    """The baseline's run-to-run noise floor and each memory arm's max |loss difference| to the baseline."""
    base = mem.get("baseline")
    if base is None or "rerun_losses" not in base["extra"]:
        return {}
    floor = max_abs_diff(base["losses"], base["extra"]["rerun_losses"])
    arms = [arm for arm in mem if arm != "baseline"]
    return {
        "floor": floor,
        "max_delta": {arm: max_abs_diff(mem[arm]["losses"], base["losses"]) for arm in arms},
        "verdict": {arm: loss_verdict(mem[arm]["losses"], base["losses"], floor) for arm in arms},
    }


def summarize(results: dict[str, Any], warmup: int) -> list[tuple[str, str, str, str, str, str]]:
    """Rows of (arm, metric, baseline, with feature, change, aim: met?)."""
    rows: list[tuple[str, str, str, str, str, str]] = []

    def med(run: dict[str, Any], key: str, skip: int = warmup) -> float:
        values = run[key][skip:]
        return statistics.median(values) if values else float("nan")

    def compare(arm: str, metric: str, key: str, run: dict[str, Any], base: dict[str, Any], aim: float | None) -> None:
        old, new = med(base, key), med(run, key)
        change = _pct(new, old)
        verdict = "" if aim is None else f"{aim:+.0f}% at most: {_verdict(change <= aim if _known(change) else None)}"
        rows.append((arm, metric, f"{old:.2f}", f"{new:.2f}", f"{change:+.1f}%", verdict))

    mem = results.get("memory", {})
    noise = loss_noise(mem)

    def same_losses(arm: str, run: dict[str, Any], base: dict[str, Any]) -> None:
        if not noise:  # no baseline rerun in these results: exact equality only
            same = run["losses"] == base["losses"]
            rows.append((arm, "losses bitwise equal", "", "", "yes" if same else "NO", _verdict(same)))
            return
        floor, delta = noise["floor"], noise["max_delta"][arm]
        rows.append((arm, "losses: max |diff| vs noise floor", f"floor {floor:.2e}", f"{delta:.2e}", "",
                     noise["verdict"][arm]))  # fmt: skip

    base = mem.get("baseline")
    if base is not None:
        for arm, peak_aim, time_aim in (("recompute", -30.0, 10.0), ("offload", -40.0, 15.0)):
            if arm in mem:
                compare(arm, "activation peak GiB", "act_peak_gib", mem[arm], base, peak_aim)
                compare(arm, "saved at end of forward GiB", "saved_gib", mem[arm], base, None)
                compare(arm, "step ms", "step_ms", mem[arm], base, time_aim)
                same_losses(arm, mem[arm], base)
        if "optimizer" in mem:
            run = mem["optimizer"]
            ratio = (base["after_step_gib"] - run["after_step_gib"]) * 2**30 / run["extra"]["param_bytes"]
            met = _verdict(ratio >= 1.995 if _known(ratio) else None)
            old, new = f"{base['after_step_gib']:.2f}", f"{run['after_step_gib']:.2f}"
            freed = f"freed {ratio:.2f}x params"
            rows.append(("optimizer", "device GiB after step", old, new, freed, f">= 2.0x: {met}"))
            compare("optimizer", "step ms", "step_ms", run, base, None)
            same_losses("optimizer", run, base)
    graphs = results.get("graphs", {})
    if "eager" in graphs:
        eager, graphed = graphs["eager"], graphs["graphed"]
        skip = 8  # the capture happens before step 4: time steady replays
        e_ms, g_ms = med(eager, "step_ms", skip), med(graphed, "step_ms", skip)
        speedup = e_ms / g_ms
        rows.append(("graphs", "step ms (1 x 512 tokens)", f"{e_ms:.2f}", f"{g_ms:.2f}", f"{speedup:.2f}x faster",
                     f">= 1.3x: {_verdict(speedup >= 1.3)}"))  # fmt: skip
        if eager.get("fwd_bwd_ms") and graphed.get("fwd_bwd_ms"):
            e_fb, g_fb = med(eager, "fwd_bwd_ms", skip), med(graphed, "fwd_bwd_ms", skip)
            rows.append(("graphs", "forward+backward ms", f"{e_fb:.2f}", f"{g_fb:.2f}", f"{e_fb / g_fb:.2f}x faster",
                         "(the captured part of the step)"))  # fmt: skip
        diffs = [abs(a - b) for a, b in zip(eager["losses"], graphed["losses"])]
        same = eager["losses"] == graphed["losses"]
        change = "identical" if same else f"max |diff| {max(diffs):.2e}"
        rows.append(("graphs", f"losses over {len(diffs)} steps", "", "", change, _verdict(same)))
        captured = graphed["extra"]["captured"]
        replays = f"replays {graphed['extra']['replays']}"
        rows.append(("graphs", "modules captured", "", "", str(len(captured)), replays))
    elif graphs:
        rows.append(("graphs", "skipped", "", "", graphs.get("skipped", ""), "n/a"))
    return rows


def print_table(rows: list[tuple[str, ...]]) -> None:
    header = ("arm", "metric", "baseline", "with feature", "change", "aim")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(line)
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {ARMS}")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch of the memory arms")
    parser.add_argument("--seq", type=int, default=None, help="sequence length of the memory arms")
    parser.add_argument("--steps", type=int, default=None, help="steps per memory arm (first --warmup not timed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--graph-steps", type=int, default=20)
    parser.add_argument("--recompute", default="moe_act,norm", help="recompute targets of the recompute arm")
    parser.add_argument("--offload", default=None, help="CPUOffload activation patterns (default: the callback's)")
    parser.add_argument("--offload-max-gib", type=float, default=None, help="CPUOffload(max_offload_gib=...)")
    parser.add_argument("--offload-prefetch", type=int, default=2, help="CPUOffload(prefetch=...)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {ARMS}")
    s = QUICK if args.quick else FULL
    s = Shape(**{**asdict(s), **{k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None}})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps = args.steps or args.warmup + (2 if args.quick else 4)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}, shape {asdict(s)}", flush=True)
    results: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "shape": asdict(s), "warmup": args.warmup}
    results["options"] = {
        "recompute": args.recompute,
        "offload": args.offload or ",".join(DEFAULT_ACTIVATIONS),
        "offload_max_gib": args.offload_max_gib,
        "offload_prefetch": args.offload_prefetch,
    }
    memory_arms = [a for a in arms if a != "graphs"]
    if memory_arms:
        recompute = [t for t in args.recompute.split(",") if t]
        patterns = None if args.offload is None else [p for p in args.offload.split(",") if p]
        results["memory"] = bench_memory_arms(
            s, memory_arms, device, dtype, steps, args.warmup, recompute, patterns, args.offload_max_gib,
            args.offload_prefetch
        )
    if "graphs" in arms:
        results["graphs"] = bench_graphs(s, device, dtype, args.graph_steps)
    if "memory" in results:
        results["loss_noise"] = loss_noise(results["memory"])
    rows = summarize(results, args.warmup)
    results["table"] = rows
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    print_table(rows)
    return results


if __name__ == "__main__":
    main()
