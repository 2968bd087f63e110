"""Worker: load an HF checkpoint onto meta-initialised folded_moe ranks, each rank its own slices.

``python worker_hf_sharded_load.py MODE HF_DIR OUT_DIR LAYOUTS [MODE HF_DIR OUT_DIR LAYOUTS ...]`` on
4 ranks (``LAYOUTS``: e.g. ``ep=4,ep=2,tp=2:etp=2:ep=2``, run one after the other in the same
processes; several groups of four arguments run in turn in one job).

* ``logits``: fp32; rank 0 compares the sharded model's logits with the one-process HF model's,
  then every rank streams its part out (``stream_export_hf``), the Trainer saves a DCP folder that
  ``lightning-moe-export --streaming`` turns back into HF files at another EP degree, and rank 0
  compares every tensor of both exports with the input checkpoint's, bit for bit;
* ``memory``: bf16; each rank's peak RSS (``VmHWM``, reset before the load) stays under
  ``(dense bytes + expert bytes / 4) * 1.3 + baseline + ALLOWANCE``, where the baseline is the
  resident size just before the load (torch, Lightning and transformers imported, meta model built).
  After that measurement the same loaded model, upcast to fp32, gives the logits of a short random
  batch; every rank frees its shards, and rank 0 compares them with transformers' ``from_pretrained``
  of the checkpoint computed in fp32 (``LOGITS_RTOL``/``LOGITS_ATOL``);
* ``pipeline``: fp32, a layout with ``pp > 1`` (e.g. ``pp=2:ep=2``, 1f1b). The checkpoint loads
  once with that layout minus ``pp`` and once with it, through ``Trainer.fit`` of one step. At fit
  start every local parameter and buffer (DTensor boxes included) equals, bit for bit, the same box
  of the one-process model (``HFMoELanguageModel(load_sharded=False)``: transformers'
  ``from_pretrained``, MoE blocks swapped, their experts stacked); at ``pp > 1`` each rank has read
  exactly its stages' checkpoint tensors and, of per-expert tensors, only its EP rank's experts.
  Rank 0 checks that the validation loss before the step and the step's ``train/loss`` of both
  loads agree (``PIPELINE_RTOL``) and prints ``PIPELINE OK <checkpoint> <layout>``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import lightning_moe  # noqa: F401 - registers the strategy names
from lightning_moe.export import main as export_main
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.strategies import FoldedMoEStrategy

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

ALLOWANCE = 256 * 1024**2  # one shard file's mapped pages, one slice, allocator slack
# fp32 logits of unit scale (the test's checkpoint keeps activations there) summed in other orders
# (FSDP-gathered weights, grouped expert GEMMs, EP combine across ranks) differ from transformers'
# by about 1e-6 after 14 layers; one wrong expert slice moves them by far more than 1e-4.
LOGITS_RTOL = LOGITS_ATOL = 1e-4
PIPELINE_RTOL = 1e-5  # the same fp32 arithmetic, summed over micro-batches and stages in another order


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def _param_bytes(hf_dir: Path) -> tuple[int, int]:
    """(dense bytes, expert bytes) of the checkpoint, from the safetensors headers."""
    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    dense = experts = 0
    for name in ckpt.weight_map:
        n = 2 * int(torch.Size(ckpt.shape(name)).numel())  # bf16
        if ".mlp.experts." in name:
            experts += n
        else:
            dense += n
    return dense, experts


def _layout(spec: str) -> dict[str, int]:
    """``"tp=2:etp=2:ep=2"`` -> ``{"tp": 2, "etp": 2, "ep": 2}``."""
    return {k: int(v) for k, v in (part.split("=") for part in spec.split(":"))}


def _trainer(layout: dict[str, int], batches: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=FoldedMoEStrategy(**layout, timeout=timedelta(seconds=240)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=batches,
    )  # fmt: skip


def _loaded(
    hf_dir: Path, layout: dict[str, int], dtype: str, batches: int = 1
) -> tuple[HFMoELanguageModel, dict[str, float], pl.Trainer]:
    """The module after ``trainer.validate`` (configure_model reads the checkpoint; ``batches=0``
    stops after the strategy's setup), and the load's resident sizes and seconds."""
    lit = HFMoELanguageModel(pretrained=str(hf_dir), load_sharded=True, dtype=dtype, moe={"experts_backend": "torch"})
    stats: dict[str, float] = {}
    load = lit.configure_model

    def measured() -> None:
        stats["baseline"] = _status_kb("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        load()
        stats["seconds"] = time.perf_counter() - start
        stats["peak"] = _status_kb("VmHWM")

    lit.configure_model = measured  # type: ignore[method-assign]
    ids = torch.randint(0, lit.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    trainer = _trainer(layout, batches)
    trainer.validate(lit, DataLoader([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], batch_size=None))
    return lit.eval(), stats, trainer


def logits(hf_dir: Path, out: Path, spec: str) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint
    from lightning_moe.checkpoint.hf_stream_export import stream_export_hf

    layout = _layout(spec)
    ep, tag = layout.get("ep", 1), spec.replace(":", "_").replace("=", "")
    lit, _, trainer = _loaded(hf_dir, layout, "float32")
    assert not any(p.is_meta for p in lit.parameters())
    ids = torch.randint(0, lit.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = lit(ids)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    export = out / f"export_{tag}"
    stream_export_hf(lit.model, export, group=dist.group.WORLD, max_shard_bytes=50_000)
    trainer.save_checkpoint(out / f"ckpt_{tag}")  # DCP folder -> HF, every rank its part, through the CLI
    from_dcp = out / f"dcp_export_{tag}"
    export_main([str(out / f"ckpt_{tag}"), str(from_dcp), "--streaming", "--ep", str(2 if ep == 4 else 4)])
    if dist.get_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        a = HFCheckpoint(hf_dir)
        for folder in (export, from_dcp):
            b = HFCheckpoint(folder)
            assert sorted(a.weight_map) == sorted(b.weight_map), set(a.weight_map) ^ set(b.weight_map)
            for name in a.weight_map:
                with safe_open(str(hf_dir / a.weight_map[name]), "pt") as fa, safe_open(
                    str(folder / b.weight_map[name]), "pt"
                ) as fb:
                    x, y = fa.get_tensor(name), fb.get_tensor(name)
                assert x.dtype == y.dtype and torch.equal(x, y), (folder.name, name)
            writers = {f.split("-")[1] for f in set(b.weight_map.values())}
            assert len(writers) == 4, writers  # every rank wrote files of its own
            again = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).float().eval()
            with torch.no_grad():
                torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=0)
        print("WORKER OK", flush=True)


def _logits_in_fp32(lit: HFMoELanguageModel, ids: torch.Tensor) -> torch.Tensor:
    """The loaded model's full logits after an in-place upcast to fp32 (exact for bf16 weights)."""
    lit.float()
    dtypes = {(p.to_local() if hasattr(p, "to_local") else p).dtype for p in lit.parameters()}
    assert dtypes == {torch.float32}, dtypes
    with torch.no_grad():
        got = lit(ids)
    return got.full_tensor() if hasattr(got, "full_tensor") else got


def _upcast_for_forward(module: nn.Module, _args: object) -> None:
    module.float()


def _back_to_bf16(module: nn.Module, _args: object, _output: object) -> None:
    module.to(torch.bfloat16)


def _transformers_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own load of the checkpoint (``from_pretrained``, one process), computed in fp32.

    It loads in the checkpoint's bf16 (a fp32 load holds twice the memory and takes three times as
    long); everything outside the decoder layers is upcast, and each decoder layer is upcast just
    for its own forward. bf16 -> fp32 is exact, so this is the fp32 model's arithmetic."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.bfloat16).eval()
    for name, child in ref.model.named_children():
        if name != "layers":
            child.float()
    ref.lm_head.float()
    for layer in ref.model.layers:
        layer.register_forward_pre_hook(_upcast_for_forward)
        layer.register_forward_hook(_back_to_bf16)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
    assert logits.dtype == torch.float32, logits.dtype
    return logits


def memory(hf_dir: Path, out: Path, spec: str) -> None:
    lit, stats, _ = _loaded(hf_dir, _layout(spec), "bfloat16", batches=0)
    assert not any(p.is_meta for p in lit.parameters())
    dense, experts = _param_bytes(hf_dir)
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in lit.parameters()
    )
    budget = (dense + experts / 4) * 1.3 + stats["baseline"] + ALLOWANCE
    report = {"rank": dist.get_rank(), "peak": stats["peak"], "baseline": stats["baseline"], "budget": budget,
              "local_param_bytes": local, "dense": dense, "experts": experts, "load_s": stats["seconds"]}  # fmt: skip
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        for r in reports:
            print(json.dumps(r), flush=True)
            assert r["peak"] <= r["budget"], r
    # After the measurement: the same loaded model, upcast, against transformers' load of the checkpoint.
    ids = torch.randint(0, lit.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    start = time.perf_counter()
    got = _logits_in_fp32(lit, ids)
    sharded_s = time.perf_counter() - start
    del lit
    gc.collect()
    dist.barrier()  # every rank's shards are freed before rank 0 loads the whole model
    if dist.get_rank() == 0:
        start = time.perf_counter()
        want = _transformers_logits(hf_dir, ids)
        comparison = {"max_abs_logit": want.abs().max().item(), "max_abs_error": (got - want).abs().max().item(),
                      "sharded_forward_s": sharded_s, "transformers_s": time.perf_counter() - start}  # fmt: skip
        print(json.dumps(comparison), flush=True)
        torch.testing.assert_close(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
        (out / "memory.json").write_text(json.dumps(reports))
        (out / "logits.json").write_text(json.dumps(comparison))
        print("WORKER OK", flush=True)


class _Recorded:
    """``load_hf_checkpoint_sharded`` wrapped: the checkpoint names each call left unread."""

    def __init__(self) -> None:
        import lightning_moe.checkpoint.hf_sharded as hf_sharded

        self.module, self.load = hf_sharded, hf_sharded.load_hf_checkpoint_sharded
        self.unread: list[list[str]] = []

    def __enter__(self) -> "_Recorded":
        def recorded(model: nn.Module, checkpoint: Any) -> list[str]:
            unread = self.load(model, checkpoint)
            self.unread.append(unread)
            return unread

        self.module.load_hf_checkpoint_sharded = recorded
        return self

    def __exit__(self, *_exc: object) -> None:
        self.module.load_hf_checkpoint_sharded = self.load


def _reference_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The one-process model's parameters and buffers (HF names): transformers' load, MoE blocks swapped."""
    ref = HFMoELanguageModel(pretrained=str(hf_dir), dtype="float32", moe={"experts_backend": "torch"})
    return {**dict(ref.model.named_parameters()), **dict(ref.model.named_buffers())}


def _hf_name(model: nn.Module, name: str) -> str:
    """The HF model's name of ``model``'s ``name`` (a rank's stages mapped, a whole model as it is)."""
    from lightning_moe.models.hf_pipeline_stage import HFLocalStages, hf_parameter_name

    if not isinstance(model, HFLocalStages):
        return name
    return f"model.{name}" if name.startswith("rotary_emb.") else hf_parameter_name(name)


def _unequal_tensors(model: nn.Module, want: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """(names whose local box differs from ``want``'s, how many tensors were compared)."""
    from lightning_moe.checkpoint.hf_sharded import local_box

    bad, seen = [], 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local, box = local_box(t.detach())
        expected = want[_hf_name(model, name)][box]
        seen += 1
        if local.dtype != expected.dtype or not torch.equal(local, expected):
            bad.append(name)
    return bad, seen


def _expected_reads(model: nn.Module, names: list[str], experts: range) -> set[str]:
    """The checkpoint names this rank's stages own: their layers' tensors (of per-expert ones those in
    ``experts``), the embedding on the first stage, the final norm and head on the last."""
    import re

    layers = {int(i) for i in model.layers}
    out: set[str] = set()
    for name in names:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if layer is not None:
            if int(layer.group(1)) in layers and (expert is None or int(expert.group(1)) in experts):
                out.add(name)
        elif name.startswith("model.embed_tokens.") and model.embed is not None:
            out.add(name)
        elif name.startswith(("model.norm.", "lm_head.")) and model.lm_head is not None:
            out.add(name)
    return out


class _CheckAtFitStart(pl.Callback):
    """At fit start (strategy set up, nothing trained): the bitwise check and what this rank read."""

    def __init__(self, want: dict[str, torch.Tensor], recorded: _Recorded, all_names: list[str]) -> None:
        self.want, self.recorded, self.all_names = want, recorded, all_names
        self.report: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = pl_module.model
        bad, seen = _unequal_tensors(model, self.want)
        self.report = {"rank": dist.get_rank(), "unequal": bad, "compared": seen}
        if trainer.strategy.pipeline_options.pp > 1:
            mesh = trainer.strategy.folded_mesh
            per_rank = int(pl_module.config.num_experts if hasattr(pl_module.config, "num_experts")
                           else pl_module.config.n_routed_experts) // mesh.size("ep")  # fmt: skip
            experts = range(mesh.rank("ep") * per_rank, (mesh.rank("ep") + 1) * per_rank)
            read = set(self.all_names) - set(self.recorded.unread[-1])
            expected = _expected_reads(model, self.all_names, experts)
            self.report |= {"stages": [i for i, _ in model.stages], "read_not_expected": sorted(read - expected),
                            "expected_not_read": sorted(expected - read), "read": len(read)}  # fmt: skip


def _fit_one_step(hf_dir: Path, layout: dict[str, int], check: _CheckAtFitStart) -> tuple[float, float]:
    """``(validation loss before the step, the step's train/loss)`` of the sharded load at ``layout``;
    every rank sees the same batch (no distributed sampler)."""
    lit = HFMoELanguageModel(pretrained=str(hf_dir), load_sharded=True, dtype="float32",
                             moe={"experts_backend": "torch"}, log_layer_load=False)  # fmt: skip
    train, val = (torch.randint(0, lit.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))
                  for seed in (11, 12))  # fmt: skip
    train_loader, val_loader = (DataLoader([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], batch_size=None)
                                for ids in (train, val))  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=FoldedMoEStrategy(**layout, timeout=timedelta(seconds=240)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        max_steps=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=1,
        use_distributed_sampler=False, callbacks=[check],
    )  # fmt: skip
    trainer.fit(lit, train_dataloaders=train_loader, val_dataloaders=val_loader)
    return lit.val_history[0][1], float(trainer.callback_metrics["train/loss"])


def pipeline(hf_dir: Path, out: Path, spec: str) -> None:
    from lightning_moe.checkpoint.hf_sharded import HFCheckpoint

    layout = _layout(spec)
    if layout.get("pp", 1) < 2:
        raise ValueError(f"pipeline mode needs a layout with pp > 1, got {spec!r}")
    want, names = _reference_tensors(hf_dir), sorted(HFCheckpoint(hf_dir).weight_map)
    results = {}
    for tag, at in (("pp1", {k: v for k, v in layout.items() if k != "pp"}), (f"pp{layout['pp']}", layout)):
        with _Recorded() as recorded:
            check = _CheckAtFitStart(want, recorded, names)
            losses = _fit_one_step(hf_dir, at, check)
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, check.report)
        results[tag] = (losses, reports)
    if dist.get_rank() == 0:
        (one, _), (many, reports) = results["pp1"], results[f"pp{layout['pp']}"]
        for report in results["pp1"][1] + reports:
            print(json.dumps(report), flush=True)
            assert report["compared"] > 0 and not report["unequal"], report
            assert not report.get("read_not_expected") and not report.get("expected_not_read"), report
        print(json.dumps({"pp1 (val, train)": one, f"{spec} (val, train)": many}), flush=True)
        torch.testing.assert_close(torch.tensor(many), torch.tensor(one), rtol=PIPELINE_RTOL, atol=0)
        print(f"PIPELINE OK {hf_dir.name} {spec}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 4:
        raise SystemExit("usage: worker_hf_sharded_load.py MODE HF_DIR OUT_DIR LAYOUTS [MODE HF_DIR OUT_DIR LAYOUTS ...]")
    for start in range(0, len(args), 4):
        mode, hf, out_dir, layouts = args[start], Path(args[start + 1]), Path(args[start + 2]), args[start + 3]
        for layout_spec in layouts.split(","):  # one layout after the other
            {"logits": logits, "memory": memory, "pipeline": pipeline}[mode](hf, out_dir, layout_spec)
    leave_together()
