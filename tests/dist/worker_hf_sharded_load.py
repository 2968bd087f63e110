"""Worker: load an HF checkpoint onto meta-initialised folded_moe ranks, each rank its own slices.

``python worker_hf_sharded_load.py MODE HF_DIR OUT_DIR LAYOUTS`` on 4 ranks (``LAYOUTS``: e.g.
``ep=4,ep=2,tp=2:etp=2:ep=2``, run one after the other in the same processes).

* ``logits``: fp32; rank 0 compares the sharded model's logits with the one-process HF model's,
  then every rank streams its part out (``stream_export_hf``), the Trainer saves a DCP folder that
  ``lightning-moe-export --streaming`` turns back into HF files at another EP degree, and rank 0
  compares every tensor of both exports with the input checkpoint's, bit for bit;
* ``memory``: bf16; each rank's peak RSS (``VmHWM``, reset before the load) stays under
  ``(dense bytes + expert bytes / 4) * 1.3 + baseline + ALLOWANCE``, where the baseline is the
  resident size just before the load (torch, Lightning and transformers imported, meta model built).
  After that measurement the same loaded model, upcast to fp32, gives the logits of a short random
  batch; every rank frees its shards, and rank 0 compares them with transformers' ``from_pretrained``
  of the checkpoint computed in fp32 (``LOGITS_RTOL``/``LOGITS_ATOL``).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

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


if __name__ == "__main__":
    mode, hf, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    for layout_spec in sys.argv[4].split(","):  # one layout after the other
        {"logits": logits, "memory": memory}[mode](hf, out_dir, layout_spec)
    leave_together()
