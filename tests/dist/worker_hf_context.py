"""Worker: swapped HF families under sequence parallel (TP2+SP) and context parallel (CP2), against one process.

``python worker_hf_context.py MODE:NAME...`` on 2 gloo ranks (FSDP off). ``MODE`` is ``sp`` (TP2 with
sequence parallel), ``cp`` (CP2, load-balanced chunks with their global positions) or ``cpdoc``
(CP2 on packed rows: documents crossing the chunk boundaries, positions restarting per document,
against the one-process model with its 4-D packed mask). Per case: a tiny random fp32 HF model
(``worker_hf_tp.build``) is swapped; a copy stays in this process as the reference; the other is
laid out. Both run the same ids and loss (logits times fixed random weights, summed); every rank
checks its part of the logits and the gradient of every parameter (DTensor gradients gathered with
``full_tensor``; under CP the plain gradients summed over the CP group) against the reference, fp32
``1e-5``. Rank 0 prints ``OK <mode>:<name> <seconds>s``.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.distributed as dist
import transformers

from lightning_moe.models.context_parallel import enable_context_parallel
from lightning_moe.models.hf import packed_forward_kwargs, swap_moe_blocks
from lightning_moe.parallel.context import shard_sequence
from lightning_moe.parallel.fold_batch import shard_batch
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import parallelize_moe_model

from _models import leave_together  # noqa: E402 - tests/dist is on sys.path for workers
from worker_hf_tp import VOCAB, build  # noqa: E402

S = 16
DOCS = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [3] * 16])  # documents cross the chunk boundaries


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 ``rtol=1e-5``, ``atol`` 1e-5 of the largest value (sums in another order round differently)."""
    atol = 1e-5 * max(1.0, float(want.abs().max())) if want.numel() else 0.0
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _grad(p: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    g = p.grad
    if hasattr(g, "full_tensor"):
        return g.full_tensor()
    g = g.clone()
    if group is not None:
        dist.all_reduce(g, group=group)
    return g


def _inputs(packed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    batch = {"input_ids": torch.randint(0, VOCAB, (2, S), generator=gen)}
    batch["weights"] = torch.randn(2, S, VOCAB, generator=gen)
    if packed:
        from lightning_moe.data.packing import position_ids_from_document_ids

        batch["document_ids"] = DOCS
        batch["position_ids"] = position_ids_from_document_ids(DOCS)
    return batch


def run(case: str, meshes: dict[str, FoldedMesh]) -> None:
    start = time.perf_counter()
    mode, name = case.split(":")
    ref = swap_moe_blocks(build(name), experts_backend="torch").train()
    model = copy.deepcopy(ref)
    batch = _inputs(packed=mode == "cpdoc")
    kwargs = {} if mode != "cpdoc" else packed_forward_kwargs(ref, batch["input_ids"], batch["document_ids"])
    want = ref(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits
    (want * batch["weights"]).sum().backward()
    group = None
    if mode == "sp":
        parallelize_moe_model(model, mesh=meshes["tp"], fsdp=False, sequence_parallel=True)
        got = model(input_ids=batch["input_ids"], use_cache=False).logits
        weights, group = batch["weights"], meshes["tp"].group("tp")
    else:
        mesh = meshes["cp"]
        group, rank = mesh.group("cp"), mesh.rank("cp")
        enable_context_parallel(model, group)
        parallelize_moe_model(model, mesh=mesh, fsdp=False)
        mine = shard_batch({k: v for k, v in batch.items() if k != "weights"}, 2, rank)
        ids = {k: mine[k] for k in ("position_ids", "document_ids") if k in mine}
        got = model(input_ids=mine["input_ids"], use_cache=False, **ids).logits
        want, weights = shard_sequence(want, 2, rank), shard_sequence(batch["weights"], 2, rank)
    (got * weights).sum().backward()
    _close(got, want, f"{case} logits")
    ours = dict(model.named_parameters())
    for key, p in ref.named_parameters():
        if p.grad is None:
            continue
        # under SP each TP rank's experts see its own tokens: their gradients add up (FSDP does it in training)
        summed = group if mode != "sp" or ".experts." in key else None
        _close(_grad(ours[key], summed), p.grad, f"{case} {key}")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK {case} {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    meshes = {
        "tp": FoldedMesh.build(FoldedLayout(world, tp=2), "cpu"),
        "cp": FoldedMesh.build(FoldedLayout(world, cp=2), "cpu"),
    }
    failed = []
    for case in sys.argv[1:]:
        try:
            run(case, meshes)
        except Exception as exc:  # noqa: BLE001 - every case is reported, the job fails at the end
            failed.append(case)
            if dist.get_rank() == 0:
                print(f"FAIL {case}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
    leave_together()
    sys.exit(1 if failed else 0)
