"""End to end on one GPU: lightning-moe vs the same model from HF transformers, in one run.

Protocol: a 4-layer model with the Qwen3-30B-A3B block
shape (hidden 2048, 32 heads, 4 KV heads, head dim 128, 128 experts, top-8, expert FFN 768),
sequence 4096, bf16, the same random-token batches and the same number of steps for every
contender, trained by ``lightning.Trainer`` in this one process:

* ``lightning_moe``      — our ``MoETransformer`` in ``MoELanguageModel`` under ``folded_moe``
                           (``auto`` when the strategy is not importable; printed);
* ``lightning_moe_hf``   — the HF ``Qwen3MoeForCausalLM`` with its MoE blocks swapped for ours
                           (``HFMoELanguageModel``), same strategy: the exact HF architecture;
* ``hf``                 — the HF ``Qwen3MoeForCausalLM`` as it is, experts_implementation
                           ``grouped_mm`` (fallback printed), in a plain ``LightningModule``, ``auto``.

Per contender: tokens/s = tokens per step / median step time over the timed steps (after
warm-up; CUDA-synchronised wall clock around each training step incl. optimizer; the mean-based
figure is reported too), MFU, and peak memory (``max_memory_allocated`` over
the whole fit: weights, gradients, AdamW state, activations; taken above what was allocated before
the contender was built, so memory an earlier contender left behind is not counted twice — a
contender that leaves memory allocated is reported). Ratios against ``hf``.
FLOPs per token = 6 * N_active + 6 * L * S * n_heads * head_dim, where N_active counts every
parameter a token touches except the input embedding (routed experts scaled by K/E; the LM head
included) and the second term is causal attention (PaLM's 12*L*H*Q*T, halved for the mask).
MFU = tokens/s * FLOPs per token / 989e12 (H200 dense bf16 peak).

``--profile`` (CUDA only; skipped with a note on CPU): after the timed steps, 2 more steps of each
contender run under ``torch.profiler`` (CUDA activity); it prints the top 20 kernels by total
GPU time (ms per step, calls per step) and the sum of all kernel time per step beside the
median step time (the difference is time the GPU sat idle: host work and launch gaps), and stores
them under ``results[contender]["profile"]``. The profiled steps are not timed.

    python benchmarks/e2e.py                       # the Qwen3-30B-A3B shape (one H200)
    python benchmarks/e2e.py --quick               # tiny shapes, CPU smoke test
    python benchmarks/e2e.py --only hf,lightning_moe_hf --out e2e.json
    python benchmarks/e2e.py --only lightning_moe --profile
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


import lightning as L
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset
from profiling import device_kernels  # noqa: E402  (benchmarks/profiling.py)

__all__ = ["CONTENDERS", "PEAK_FLOPS", "Shape", "active_params", "flops_per_token", "main", "run"]

PEAK_FLOPS = 989e12  # H200 SXM dense bf16
PROFILE_STEPS = 2  # steps profiled after the timed ones under --profile
TOP_KERNELS = 20
CONTENDERS = ("lightning_moe", "lightning_moe_fp8", "lightning_moe_hf", "hf")
FORMULA = (
    "flops/token = 6*N_active + 6*L*S*n_heads*head_dim  (N_active: parameters a token touches, input embedding "
    "excluded, routed experts x K/E, LM head included; attention causal = PaLM 12*L*H*Q*T halved); "
    "MFU = tokens/s * flops/token / 989e12 (H200 dense bf16 peak)"
)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Model and run shape. Defaults: the Qwen3-30B-A3B block, 4 layers."""

    layers: int = 4
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_ffn: int = 768
    vocab: int = 32768
    seq_len: int = 4096
    batch_size: int = 4
    warmup: int = 3
    steps: int = 10
    precision: str = "bf16-true"
    aux_loss_coeff: float = 1e-3
    learning_rate: float = 1e-4


QUICK = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, expert_ffn=32, vocab=256,
              seq_len=64, batch_size=2, warmup=1, steps=2, precision="32-true")  # fmt: skip


# --- data, timing, accounting ------------------------------------------------------------------


class RandomTokens(Dataset):
    """Deterministic random windows: sample ``i`` is the same for every contender."""

    def __init__(self, num: int, seq_len: int, vocab: int) -> None:
        self.num, self.seq_len, self.vocab = num, seq_len, vocab

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": w[:-1], "labels": w[1:]}


class StepTimer(Callback):
    """Wall clock of each training step (forward, backward, optimizer), device-synchronised."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._t0)


class StepProfiler(Callback):
    """``torch.profiler`` (CUDA activity) around ``steps`` training steps from the ``start``-th (0-based)."""

    def __init__(self, start: int, steps: int = PROFILE_STEPS) -> None:
        self.start, self.steps = start, steps
        self.prof: profile | None = None
        self._seen = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._seen == self.start:
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._seen += 1
        if self.prof is not None and self._seen == self.start + self.steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)

    def kernels(self) -> list[dict[str, Any]]:
        """Every device event of the profiled steps by name: total ms and count, longest first."""
        if self.prof is None:
            raise RuntimeError(f"profiler never started (expected it at step {self.start})")
        return device_kernels(self.prof)


def profile_report(kernels: list[dict[str, Any]], steps: int, step_ms_median: float) -> dict[str, Any]:
    """Top kernels per step, and all kernel time per step beside the measured (median, unprofiled) step."""
    kernel_ms = sum(k["total_ms"] for k in kernels) / steps
    top = [
        {"name": k["name"], "ms_per_step": k["total_ms"] / steps, "count": k["count"]} for k in kernels[:TOP_KERNELS]
    ]
    return {"steps": steps, "kernel_ms_per_step": kernel_ms, "step_ms_median": step_ms_median,
            "idle_ms_per_step": step_ms_median - kernel_ms, "distinct_kernels": len(kernels),
            "top_kernels": top}  # fmt: skip


def print_profile(name: str, prof: dict[str, Any]) -> None:
    if "error" in prof:
        print(f"[{name}] profile failed: {prof['error']}", flush=True)
        return
    steps = prof["steps"]
    print(f"[{name}] top {len(prof['top_kernels'])} of {prof['distinct_kernels']} CUDA kernels over {steps} profiled "
          f"steps (ms per step, calls per step):", flush=True)  # fmt: skip
    for k in prof["top_kernels"]:
        print(f"    {k['name'][:70]:<70}  {k['ms_per_step']:9.3f}  {k['count'] / steps:7.1f}", flush=True)
    busy = prof["kernel_ms_per_step"]
    step = prof["step_ms_median"]
    print(f"[{name}] kernel time {busy:.1f} ms/step vs measured step {step:.1f} ms (median, unprofiled): "
          f"GPU busy {100 * busy / step:.1f} %, idle {prof['idle_ms_per_step']:.1f} ms (host, launch gaps)", flush=True)


def active_params(model: nn.Module, top_k: int, num_experts: int) -> int:
    """Parameters one token touches: all but the input embedding, routed experts scaled by K/E."""
    total = 0.0
    for name, p in model.named_parameters():
        if "embed" in name:
            continue
        scale = top_k / num_experts if (".experts." in name or name.startswith("experts.")) else 1.0
        total += p.numel() * scale
    return int(total)


def flops_per_token(n_active: int, shape: Shape, head_dim: int) -> float:
    return 6.0 * n_active + 6.0 * shape.layers * shape.seq_len * shape.heads * head_dim


# --- the contenders ----------------------------------------------------------------------------


def hf_config_dict(shape: Shape, experts_implementation: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "qwen3_moe", "vocab_size": shape.vocab, "hidden_size": shape.hidden,
        "intermediate_size": 3 * shape.hidden, "moe_intermediate_size": shape.expert_ffn,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": shape.seq_len, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_cache": False, "output_router_logits": True,
        "router_aux_loss_coef": shape.aux_loss_coeff,
    }  # fmt: skip
    if experts_implementation is not None:
        cfg["experts_implementation"] = experts_implementation
    return cfg


class HFPlainLM(L.LightningModule):
    """What a user writes without lightning-moe: the HF model, CE + HF's aux loss, AdamW."""

    def __init__(self, model: nn.Module, learning_rate: float, aux_loss_coeff: float) -> None:
        super().__init__()
        self.model = model
        self.learning_rate = learning_rate
        self.aux_loss_coeff = aux_loss_coeff

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], use_cache=False)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten())
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + self.aux_loss_coeff * out.aux_loss.to(loss.dtype)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)


def build_hf_plain(shape: Shape, device: str) -> tuple[L.LightningModule, dict[str, Any]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    notes: dict[str, Any] = {}
    model = None
    for impl in ("grouped_mm", None):
        cfg = hf_config_dict(shape, None)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "dtype": _model_dtype(shape)}
        if impl is not None:
            kwargs["experts_implementation"] = impl
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            break
        except (TypeError, ValueError, ImportError) as err:  # 4.x has no such kwarg; grouped_mm may not dispatch
            notes["experts_implementation_fallback"] = f"grouped_mm refused: {type(err).__name__}: {err}"
            print(f"[hf] experts_implementation='grouped_mm' unavailable ({err}); using the default", flush=True)
    assert model is not None
    used = getattr(model.config, "_experts_implementation", None)
    notes["experts_implementation"] = used
    if used != "grouped_mm":
        print(f"[hf] running experts_implementation={used!r}, not grouped_mm", flush=True)
    return HFPlainLM(model, shape.learning_rate, shape.aux_loss_coeff), notes


def build_lightning_moe_hf(shape: Shape, device: str) -> tuple[L.LightningModule, dict[str, Any]]:
    from lightning_moe.lit_hf import HFMoELanguageModel

    cfg = hf_config_dict(shape, None)
    moe = {"aux_loss": "switch", "aux_loss_coeff": shape.aux_loss_coeff}
    with torch.device(device):
        lit = HFMoELanguageModel(hf_config=cfg, moe=moe, dtype=_dtype_name(shape), learning_rate=shape.learning_rate,
                                 warmup_steps=1, log_layer_load=False)  # fmt: skip
    return lit, {}


def build_lightning_moe(
    shape: Shape, device: str, fp8: Any = None, **config: Any
) -> tuple[L.LightningModule, dict[str, Any]]:
    """Our model at ``shape``; ``fp8``: an ``Fp8Config`` for the experts; ``config``: more
    ``TransformerConfig`` fields (``recompute``, ``attention_backend``)."""
    from lightning_moe.config import MoEConfig
    from lightning_moe.lit import MoELanguageModel
    from lightning_moe.models.transformer import TransformerConfig

    notes: dict[str, Any] = {}
    moe = MoEConfig(hidden_size=shape.hidden, ffn_hidden_size=shape.expert_ffn, num_experts=shape.experts,
                    top_k=shape.top_k, score_func="softmax", pre_softmax=True, norm_topk_prob=True,
                    aux_loss="switch", aux_loss_coeff=shape.aux_loss_coeff, fp8=fp8)  # fmt: skip
    kwargs: dict[str, Any] = {"vocab_size": shape.vocab, "hidden_size": shape.hidden, "num_layers": shape.layers,
                                  "num_heads": shape.heads, "num_kv_heads": shape.kv_heads, "moe": moe,
                                  "max_seq_len": shape.seq_len, "rope_theta": 1e6, "norm_eps": 1e-6,
                                  **config}  # fmt: skip
    names = {f.name for f in fields(TransformerConfig)}
    if "head_dim" in names:
        kwargs["head_dim"] = shape.head_dim
    elif shape.hidden // shape.heads != shape.head_dim:
        notes["head_dim"] = shape.hidden // shape.heads
        print(f"[lightning_moe] TransformerConfig has no head_dim field: runs head_dim={shape.hidden // shape.heads} "
              f"(Qwen3: {shape.head_dim}); lightning_moe_hf is the exact architecture", flush=True)  # fmt: skip
    if "qk_norm" in names:
        kwargs["qk_norm"] = True
    else:
        notes["qk_norm"] = False
    with torch.device(device):
        lit = MoELanguageModel(TransformerConfig(**kwargs), learning_rate=shape.learning_rate, warmup_steps=1,
                               log_layer_load=False)  # fmt: skip
    if _model_dtype(shape) != torch.float32:
        lit = lit.to(_model_dtype(shape))
    return lit, notes


def build_lightning_moe_fp8(shape: Shape, device: str) -> tuple[L.LightningModule, dict[str, Any]]:
    """Our model with FP8 experts (blockwise 1x128 / 128x128, DeepSeek-V3's recipe), the rest bf16."""
    from lightning_moe.config import Fp8Config

    backend = "auto" if device == "cuda" else "emulate"  # CPU: the numerics only (smoke runs)
    lit, notes = build_lightning_moe(shape, device, fp8=Fp8Config(recipe="blockwise", enabled="on", backend=backend))
    return lit, {**notes, "fp8": "experts, blockwise"}


BUILDERS = {
    "lightning_moe": build_lightning_moe, "lightning_moe_fp8": build_lightning_moe_fp8,
    "lightning_moe_hf": build_lightning_moe_hf, "hf": build_hf_plain,
}  # fmt: skip


def _model_dtype(shape: Shape) -> torch.dtype:
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(shape.precision, torch.float32)


def _dtype_name(shape: Shape) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(_model_dtype(shape), "float32")


def folded_moe_available() -> bool:
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_moe  # noqa: F401 - registers the strategy names
    except ImportError:
        return False
    return "folded_moe" in StrategyRegistry


# --- running -----------------------------------------------------------------------------------


def _head_dim(lit: L.LightningModule, shape: Shape, notes: dict[str, Any]) -> int:
    return int(notes.get("head_dim", shape.head_dim))


def run_one(
    name: str,
    shape: Shape,
    device: str,
    strategy: str,
    profile_steps: int = 0,
    *,
    builder: Callable[[Shape, str], tuple[L.LightningModule, dict[str, Any]]] | None = None,
    dataset: Dataset | None = None,
    callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any]:
    """Build, train ``warmup + steps`` steps, and measure one contender (then ``profile_steps`` profiled).

    ``builder`` (default ``BUILDERS[name]``), ``dataset`` (default random tokens; at least
    ``(warmup + steps + profile_steps) * batch_size`` items, read in order) and ``callbacks`` (added
    to the Trainer's) let other benchmarks run their own variants through the same loop.
    """
    torch.manual_seed(0)
    gc.collect()
    # What an earlier contender left allocated is not this one's: the peak is taken above it.
    held_before = torch.cuda.memory_allocated() if device == "cuda" else 0
    lit, notes = (builder or BUILDERS[name])(shape, device)
    n_active = active_params(lit, shape.top_k, shape.experts)
    timer = StepTimer()
    total_steps = shape.warmup + shape.steps
    trainer_callbacks: list[Callback] = [timer, *callbacks]
    if profile_steps:
        profiler = StepProfiler(start=total_steps, steps=profile_steps)
        trainer_callbacks.append(profiler)
        total_steps += profile_steps
    if dataset is None:
        dataset = RandomTokens(total_steps * shape.batch_size, shape.seq_len, shape.vocab)
    data = DataLoader(dataset, batch_size=shape.batch_size)
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy, precision=shape.precision,
        max_steps=total_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=trainer_callbacks,
    )  # fmt: skip
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(lit, data)
    peak = (torch.cuda.max_memory_allocated() - held_before) / 2**30 if device == "cuda" else None
    timed = timer.times[shape.warmup : shape.warmup + shape.steps]
    if len(timed) != shape.steps:
        raise RuntimeError(f"{name}: timed {len(timed)} steps, expected {shape.steps}")
    median = sorted(timed)[len(timed) // 2]
    tok_s = shape.batch_size * shape.seq_len / median  # median step: robust to a stray slow step
    fpt = flops_per_token(n_active, shape, _head_dim(lit, shape, notes))
    result = {
        "strategy": strategy, "tokens_per_s": tok_s, "step_ms_median": 1e3 * median,
        "tokens_per_s_mean": shape.steps * shape.batch_size * shape.seq_len / sum(timed),
        "step_ms": [round(1e3 * t, 2) for t in timed], "mfu": tok_s * fpt / PEAK_FLOPS, "flops_per_token": fpt,
        "active_params": n_active, "total_params": sum(p.numel() for p in lit.parameters()),
        "peak_memory_gib": peak, **notes,
    }  # fmt: skip
    if profile_steps:
        try:
            result["profile"] = profile_report(profiler.kernels(), profile_steps, 1e3 * median)
        except Exception as err:  # noqa: BLE001 - a profiler failure must not lose the timings
            result["profile"] = {"error": f"{type(err).__name__}: {err}"}
        result["profile"]["profiled_step_ms"] = [round(1e3 * t, 2) for t in timer.times[-profile_steps:]]
    # Lightning gives every callback the module's bound log methods; the timer outliving the Trainer
    # would keep the module (and its optimizer) alive under strategies that do not take them back.
    del trainer, lit, data, trainer_callbacks, timer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        result["left_allocated_gib"] = (torch.cuda.memory_allocated() - held_before) / 2**30
        if result["left_allocated_gib"] > 0.25:
            _report_leftovers(name, result["left_allocated_gib"])
    return result


def live_optimizers() -> list[torch.optim.Optimizer]:
    """Every optimizer the garbage collector still tracks (Lightning's wrappers included)."""
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.optim.Optimizer)]


def _report_leftovers(name: str, gib: float) -> None:
    """A contender's device memory outlived it: say so, and name the optimizers still alive and who holds them."""
    print(f"[{name}] WARNING: {gib:.2f} GiB still allocated after the contender was deleted", flush=True)
    for opt in live_optimizers():
        holders = [type(r).__name__ for r in gc.get_referrers(opt) if not isinstance(r, list)]
        print(f"[{name}]   live {type(opt).__name__} held by {holders[:8]}", flush=True)


def run(
    shape: Shape, only: tuple[str, ...] = CONTENDERS, strategy: str | None = None, profile_kernels: bool = False
) -> dict[str, Any]:
    """Every contender in ``only`` on ``shape``; a contender that fails is reported, not fatal.

    ``profile_kernels``: on CUDA, profile ``PROFILE_STEPS`` more steps of each contender (skipped on CPU).
    """
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = strategy or ("folded_moe" if folded_moe_available() else "auto")
    print(f"device={device}  lightning-moe strategy={ours}" + ("" if ours == "folded_moe" else
          "  (folded_moe not importable)"), flush=True)  # fmt: skip
    print(f"shape: {asdict(shape)}", flush=True)
    print(FORMULA, flush=True)
    profile_steps = PROFILE_STEPS if profile_kernels and device == "cuda" else 0
    if profile_kernels and not profile_steps:
        print(f"--profile: skipped, CUDA kernel profiling needs a CUDA device (device={device})", flush=True)
    had_pg = dist.is_available() and dist.is_initialized()
    results: dict[str, Any] = {}
    for name in only:
        strat = "auto" if name == "hf" else ours
        try:
            results[name] = run_one(name, shape, device, strat, profile_steps)
        except Exception as err:  # noqa: BLE001 - one failing contender must not hide the others
            tb = traceback.format_exc(limit=6)
            print(f"[{name}] FAILED: {type(err).__name__}: {err}\n{tb}", flush=True)
            results[name] = {"error": f"{type(err).__name__}: {err}", "strategy": strat}
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        r = results[name]
        if "error" not in r:
            peak = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f} GiB"
            print(f"[{name}] {r['tokens_per_s']:,.0f} tokens/s  MFU {100 * r['mfu']:.2f} %  peak {peak}  "
                  f"median step {r['step_ms_median']:.1f} ms  ({r['strategy']})", flush=True)  # fmt: skip
            if "profile" in r:
                print_profile(name, r["profile"])
    if not had_pg and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # the strategy made one; leave the process as we found it
    ratios = {}
    base = results.get("hf", {})
    for name in ("lightning_moe", "lightning_moe_hf"):
        r = results.get(name, {})
        if "tokens_per_s" in r and "tokens_per_s" in base:
            ratios[f"{name}/hf tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
            if device == "cuda":
                ratios[f"{name}/hf peak_memory"] = r["peak_memory_gib"] / base["peak_memory_gib"]
    fp8, bf16 = results.get("lightning_moe_fp8", {}), results.get("lightning_moe", {})
    if "tokens_per_s" in fp8 and "tokens_per_s" in bf16:
        ratios["lightning_moe_fp8/lightning_moe tokens_per_s"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    for key, value in ratios.items():
        aim = "  (aim >= 1.25)" if "fp8" in key else ("  (aim >= 1.5)" if "tokens" in key else "")
        print(f"ratio {key}: {value:.3f}{aim}", flush=True)
    return {"shape": asdict(shape), "device": _device_name(device), "formula": FORMULA, "results": results,
            "ratios": ratios, "versions": _versions()}  # fmt: skip


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _versions() -> dict[str, str]:
    import lightning

    out = {"torch": torch.__version__, "lightning": lightning.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = "missing"
    return out


def write_report(out: str | Path, report: dict[str, Any]) -> None:
    """``report`` as JSON at ``out`` (its folder made if missing); the benchmarks built on this one share it."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    ap.add_argument("--strategy", default=None, help="lightning-moe strategy (default: folded_moe if importable)")
    ap.add_argument("--out", default=None, help="JSON path (default: no file)")
    ap.add_argument("--profile", action="store_true",
                    help=f"CUDA: profile {PROFILE_STEPS} more steps per contender, print the top kernels")  # fmt: skip
    for f in fields(Shape):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    a = ap.parse_args(argv)
    shape = QUICK if a.quick else Shape()
    overrides = {f.name: getattr(a, f.name) for f in fields(Shape) if getattr(a, f.name) is not None}
    shape = replace(shape, **overrides)
    only = tuple(s for s in a.only.split(",") if s)
    unknown = set(only) - set(CONTENDERS)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {CONTENDERS}")
    report = run(shape, only, a.strategy, profile_kernels=a.profile)
    if a.out:
        write_report(a.out, report)
    return report


if __name__ == "__main__":
    main()
