"""Saved-for-backward bytes by shape, our transformer vs the swapped HF model (one layer, bf16, CUDA)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.autograd.graph import saved_tensors_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
import e2e  # noqa: E402

shape = e2e.Shape(layers=1)
T, H = shape.seq_len * shape.batch_size, shape.hidden
for name in ("lightning_moe", "lightning_moe_hf"):
    torch.manual_seed(0)
    lit, _ = e2e.BUILDERS[name](shape, "cuda")
    lit = lit.to(torch.bfloat16)
    ids = torch.randint(0, shape.vocab, (shape.batch_size, shape.seq_len), device="cuda")
    seen: dict[int, int] = {}
    by_shape: collections.Counter = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            by_shape[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += seen[key]
        return t

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with saved_tensors_hooks(pack, lambda t: t):
        loss = lit._lm_loss({"input_ids": ids, "labels": ids})
    after_fwd = torch.cuda.memory_allocated() - base
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    u = T * H * 2
    print(f"== {name}: saved {sum(seen.values()) / 2**30:.2f} GiB ({sum(seen.values()) / u:.1f} u of [T,H] bf16); "
          f"held after forward {after_fwd / 2**30:.2f} GiB; peak over fwd+bwd {peak / 2**30:.2f} GiB", flush=True)
    for (shp, dt), b in by_shape.most_common(16):
        print(f"   {b / u:6.2f} u  {shp} {dt}", flush=True)
    del lit, loss
    torch.cuda.empty_cache()
