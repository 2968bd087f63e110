"""Worker: each swapped HF family, its attention and dense MLPs cut by its TP plan, equals one process.

``python worker_hf_tp.py NAME...`` on 2 gloo ranks (TP2, FSDP off). Per family: a tiny random
fp32 HF model (the configs of ``tests/unit/test_hf_families.py`` and ``test_hf_swap.py``, plus
the variants in ``VARIANTS``) is swapped; a copy stays in this process as the reference; the
other is parallelized at TP2. Both run the same ids and the same loss (logits times fixed random
weights, summed); every rank checks the logits and the gradient of every parameter (DTensor
gradients gathered with ``full_tensor``) against the reference, fp32 ``atol=1e-5``. Rank 0 prints
``TP OK <name> <seconds>s``.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from lightning_moe.models.hf import swap_moe_blocks
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import parallelize_moe_model
from lightning_moe.parallel.tp_apply import tp_targets

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_hf_swap  # noqa: E402
from test_hf_families import CONFIGS, VOCAB, hf_model  # noqa: E402

# name -> (family config of test_hf_families, changes)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next_full_attention": ("qwen3_next", dict(layer_types=["full_attention", "full_attention"])),
    "qwen3_5_moe_full_attention": ("qwen3_5_moe", dict(layer_types=["full_attention", "full_attention"])),
    "minimax_full_attention": ("minimax", dict(layer_types=["full_attention", "full_attention"])),
    "deepseek_v2_no_q_lora": ("deepseek_v2", dict(q_lora_rank=None)),
    "glm4_moe_qk_norm": ("glm4_moe", dict(use_qk_norm=True)),
    "llama4_dense_mlp": ("llama4", dict(interleave_moe_layer_step=2)),
}


def build(name: str) -> torch.nn.Module:
    if name in test_hf_swap.CONFIGS:
        return test_hf_swap._model(name)
    if name in VARIANTS:
        base, changes = VARIANTS[name]
        return hf_model(base, **changes)
    assert name in CONFIGS, name
    return hf_model(name)


def _grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def run(name: str, mesh: FoldedMesh) -> None:
    start = time.perf_counter()
    ref = swap_moe_blocks(build(name), experts_backend="torch").train()
    model = copy.deepcopy(ref)
    parallelize_moe_model(model, mesh=mesh, fsdp=False)
    cut = [n for n, m, plan in tp_targets(model) if any(isinstance(p, DTensor) for p in m.parameters())]
    assert cut and len(cut) == len(tp_targets(model)), (name, cut)  # every attention and dense MLP is cut
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 10), generator=gen)
    weights = torch.randn(2, 10, VOCAB, generator=gen)
    want = ref(input_ids=ids, use_cache=False).logits
    got = model(input_ids=ids, use_cache=False).logits
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} logits: {m}")
    ours = dict(model.named_parameters())
    for key, p in ref.named_parameters():
        if p.grad is None:
            assert ours[key].grad is None, (name, key)
            continue
        torch.testing.assert_close(_grad(ours[key]), p.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    if dist.get_rank() == 0:
        print(f"TP OK {name} {time.perf_counter() - start:.1f}s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    mesh = FoldedMesh.build(FoldedLayout(dist.get_world_size(), tp=2), "cpu")
    for family in sys.argv[1:]:
        run(family, mesh)
    leave_together()
