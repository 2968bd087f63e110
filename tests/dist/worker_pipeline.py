"""Worker: pipeline-parallel steps of a tiny MoETransformer equal one process, on W gloo ranks.

``python worker_pipeline.py PART...``; a part is ``<schedule>:v=<virtual stages>:n=<micro-batches>``
(e.g. ``1f1b:v=1:n=4``). Every part runs on ``FoldedLayout(W, pp=2)`` (``dp = W / 2`` pipelines
side by side) through ``FoldedMesh``: each rank cuts its stages from the same seeded model
(``split_layers``, ``stage_indices``, ``build_transformer_stage``), wraps them in torch's
``PipelineStage`` on the mesh's pp group and runs one step of ``build_schedule``'s schedule on its
data-parallel shard of the batch. The gradients are then averaged over the dp group.

Every rank compares with one process that runs the same batch as the same micro-batches, each loss
and each aux loss scaled by ``1 / (dp * n)``: the mean loss over the micro-batches (last stage) and
every gradient of its stages' parameters, rtol 1e-5. The router weights' gradients carry the load
balancing and z-losses: they must match too, and must differ from a run without aux losses. Rank 0
prints ``PART OK <part> <seconds>s`` after the part's barrier.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import MoETransformer, TransformerConfig, rope_tables
from lightning_moe.moe.utils import set_aux_loss_scale
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.pipeline import check_batch_split, split_layers, stage_indices
from lightning_moe.parallel.pipeline_schedule import build_schedule
from lightning_moe.parallel.pipeline_stage import build_transformer_stage

PP, NUM_LAYERS, VOCAB, SEQ, MICRO = 2, 4, 64, 8, 2
RTOL, ATOL = 1e-5, 1e-8


def model_config(aux: bool = True) -> TransformerConfig:
    moe = MoEConfig(
        hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss="switch" if aux else "none",
        aux_loss_coeff=0.1, z_loss_coeff=1e-2 if aux else None,
    )  # fmt: skip
    return TransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2, moe=moe,
        num_dense_layers=1, dense_ffn_hidden_size=32, max_seq_len=SEQ,
    )  # fmt: skip


def seeded_model(aux: bool = True) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(model_config(aux))


def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())


def reference(model: MoETransformer, ids: torch.Tensor, labels: torch.Tensor, n_micro: int) -> torch.Tensor:
    """One process: the mean loss over the micro-batches of ``ids`` (rows in order), gradients in ``.grad``."""
    chunks = ids.shape[0] // MICRO
    set_aux_loss_scale(model, 1.0 / chunks)
    total = torch.zeros(())
    for x, y in zip(ids.split(MICRO), labels.split(MICRO)):
        loss = lm_loss(model(x), y) / chunks
        loss.backward()
        total += loss.detach()
    return total


def run_part(part: str, world: int) -> None:
    schedule, v_spec, n_spec = part.split(":")
    virtual, n_micro = int(v_spec.removeprefix("v=")), int(n_spec.removeprefix("n="))
    layout = FoldedLayout(world, pp=PP)
    mesh = FoldedMesh.build(layout, "cpu")
    pp_rank, dp_rank, dp = mesh.rank("pp"), mesh.rank("dp"), layout.dp
    rows = dp * n_micro * MICRO
    check_batch_split(rows // dp, n_micro)
    ids, labels = batch(rows)

    model = seeded_model()
    ref = copy.deepcopy(model)
    ref_loss = reference(ref, ids, labels, n_micro)
    no_aux = seeded_model(aux=False)
    reference(no_aux, ids, labels, n_micro)

    cfg = model.config
    tables = lambda S, device: rope_tables(S, cfg.head_dim, cfg.rope_theta, device)  # noqa: E731
    ranges = split_layers(NUM_LAYERS, PP, virtual)
    mine = stage_indices(pp_rank, PP, schedule, virtual)
    modules = [build_transformer_stage(model, ranges[s], NUM_LAYERS, tables) for s in mine]
    stages = [
        PipelineStage(m, s, PP * virtual, torch.device("cpu"), group=mesh.group("pp")) for m, s in zip(modules, mine)
    ]
    runner = build_schedule(schedule, stages, n_micro, lm_loss)

    shard = slice(dp_rank * n_micro * MICRO, (dp_rank + 1) * n_micro * MICRO)
    first = any(m.is_first for m in modules)
    last = any(m.is_last for m in modules)
    losses: list[torch.Tensor] = []
    args = (ids[shard],) if first else ()
    runner.step(*args, target=labels[shard] if last else None, losses=losses if last else None)

    checked = []
    ref_params = dict(ref.named_parameters())
    no_aux_params = dict(no_aux.named_parameters())
    for m in modules:
        for name, p in m.named_parameters():
            if p.grad is None:
                raise AssertionError(f"{part}: rank {dist.get_rank()} {name} has no gradient")
            grad = p.grad.clone()
            dist.all_reduce(grad, group=mesh.group("dp"))
            grad /= dp
            torch.testing.assert_close(grad, ref_params[name].grad, rtol=RTOL, atol=ATOL, msg=lambda s, n=name: f"{part} {n}: {s}")
            if "router" in name:
                gap = (no_aux_params[name].grad - ref_params[name].grad).abs().max()
                if gap < 1e3 * ATOL + RTOL * ref_params[name].grad.abs().max():
                    raise AssertionError(f"{part} {name}: the aux losses barely move the router gradient ({gap})")
            checked.append(name)
    if not any("router" in n for n in checked) and any(".ffn." in n for n in checked if "layers.0." not in n):
        raise AssertionError(f"{part}: no router weight among the checked parameters {checked}")
    if last:
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, group=mesh.group("dp"))
        torch.testing.assert_close(loss / dp, ref_loss, rtol=RTOL, atol=ATOL)
    counts = torch.tensor([len(checked)])
    dist.all_reduce(counts)
    if counts.item() != dp * len(ref_params):
        raise AssertionError(f"{part}: {counts.item()} parameters checked over all ranks, want {dp} x {len(ref_params)}")


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for part in sys.argv[1:]:
        start = time.perf_counter()
        run_part(part, world)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"PART OK {part} {time.perf_counter() - start:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
