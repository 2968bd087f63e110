"""Worker: sequence parallel and the vocab-parallel head against one process, on gloo ranks.

``python worker_sequence_parallel.py OUT_DIR SPEC...`` under torchrun; a SPEC is
``tp=2,ep=4,sp=1[,etp=2][,vp=1][,dispatcher=alltoall][,recompute=1]`` (recompute: norms, MoE
activations and attention rebuilt in backward), or ``vocab`` (the vocab-parallel
embedding and cross-entropy alone at TP 2 and 4: ``OUT_DIR/vocab.pt`` holds every rank's
relative errors). For each layout, every rank builds the same
small :class:`MoETransformer` from one seed, keeps a one-process copy, shards the other with
``parallelize_moe_model`` (FSDP2 included), and trains 3 SGD steps on its DP shard's batch
(the copy trains on every DP shard, averaged). Rank 0 writes ``OUT_DIR/<SPEC>.pt`` with:

* ``losses`` / ``ref_losses``: every rank's loss per step and the one-process loss of its DP shard;
* ``grads`` / ``ref_grads``: the full gradients after the first backward; ``grad_norms``: per
  rank, ``parallel.grad.grad_norm`` of them (what clipping uses) and the one-process norm;
* ``state`` / ``ref_state``: the full parameters after the 3 steps;
* ``moe_tokens`` / ``expert_rows``: per rank, tokens entering each MoE layer and rows entering
  its experts in the first forward; ``tp_groups``, ``etp``, ``top_k``, ``tokens_per_rank``;
* ``saved``: at the first spec only, bytes autograd saves inside the residual norms and inside
  the first block, one process (TP1) and this layout (per rank).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import set_aux_loss_scale
from lightning_moe.parallel.checkpoint import gather_full_state
from lightning_moe.parallel.grad import grad_norm
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import parallelize_moe_model, unblock_w13
from lightning_moe.parallel.vocab import VocabParallelEmbedding, lm_cross_entropy, vocab_parallel_cross_entropy

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 2, 3, 0.5


def model_config(recompute: list | None = None) -> TransformerConfig:
    moe = MoEConfig(
        hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, aux_loss="switch", aux_loss_coeff=0.01,
        z_loss_coeff=1e-3, shared_expert_ffn_size=16,
    )  # fmt: skip
    return TransformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, moe=moe, qk_norm=True,
        num_dense_layers=1, dense_ffn_hidden_size=32, max_seq_len=SEQ, recompute=recompute or [],
    )  # fmt: skip


def batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 97 * step + dp_rank)
    w = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = w[:, 1:].clone()
    labels[0, :2] = -100  # ignored positions
    return w[:, :-1], labels


def parse(spec: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in spec.split(","):
        k, v = item.split("=")
        out[k] = v if k == "dispatcher" else int(v)
    return out


def full_grads(model: torch.nn.Module, etp: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if isinstance(g, DTensor) else g
        g = g.detach().cpu().clone()
        if name.endswith("experts.w13"):
            g = unblock_w13(g, etp)
        out[name] = g
    return out


def count_rows(model: torch.nn.Module) -> tuple[list[int], list[int], list]:
    """Tokens into each MoE layer and rows into its experts (first forward only)."""
    tokens: list[int] = []
    rows: list[int] = []
    handles = []
    for m in model.modules():
        if isinstance(m, MoELayer):
            handles.append(m.register_forward_pre_hook(lambda mod, args: tokens.append(args[0].numel() // args[0].shape[-1])))
            handles.append(m.experts.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0])))
    return tokens, rows, handles


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Bytes saved for backward inside the residual norms and inside the first block (local shards)."""
    where: list[str] = []
    counts = {"norms": 0, "block": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        n = local.numel() * local.element_size()
        for key in where:
            counts[key] += n
        return t

    def enter(key):
        return lambda mod, args: where.append(key)

    def leave(key):
        return lambda mod, args, out: where.remove(key)

    handles = []
    root = model
    for name in ("attn_norm", "ffn_norm"):
        for block in root.layers:
            m = getattr(block, name)
            handles += [m.register_forward_pre_hook(enter("norms")), m.register_forward_hook(leave("norms"))]
    first = root.layers[1]  # the first MoE block
    handles += [first.register_forward_pre_hook(enter("block")), first.register_forward_hook(leave("block"))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        root(ids)
    for h in handles:
        h.remove()
    return counts


def run(spec: str, out_dir: Path, measure_saved: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    opts = parse(spec)
    tp, ep, etp = int(opts.get("tp", 1)), int(opts.get("ep", 1)), int(opts.get("etp", 1))
    sp, vp = bool(opts.get("sp", 0)), bool(opts.get("vp", 0))
    recompute = ["norm", "moe_act", "attn"] if opts.get("recompute", 0) else []
    layout = FoldedLayout(world, tp=tp, ep=ep, etp=etp)
    mesh = FoldedMesh.build(layout, "cpu")
    dp, dp_rank = layout.dp, mesh.rank("dp")

    torch.manual_seed(0)
    ref = MoETransformer(model_config(recompute))
    model = copy.deepcopy(ref)
    saved: dict[str, dict[str, int]] = {}
    if measure_saved:
        ids0, _ = batch(0, 0)
        saved["tp1"] = saved_bytes(ref, ids0)
        ref.zero_grad(set_to_none=True)
    parallelize_moe_model(
        model, mesh=mesh, dispatcher=str(opts.get("dispatcher", "alltoall_dedup")), shard_root=True,
        sequence_parallel=sp, vocab_parallel=vp,
    )  # fmt: skip
    if measure_saved:
        ids0, _ = batch(dp_rank, 0)
        saved["parallel"] = saved_bytes(model, ids0)
        model.zero_grad(set_to_none=True)

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    set_aux_loss_scale(ref, 1.0 / dp)
    losses, ref_losses = [], []
    grads = ref_grads = None
    tokens, rows, handles = count_rows(model)
    for step in range(STEPS):
        ids, labels = batch(dp_rank, step)
        loss = lm_cross_entropy(model, model(ids), labels)
        loss.backward()
        for h in handles:
            h.remove()
        handles = []
        losses.append(float(loss.detach()))
        for d in range(dp):
            ids_d, labels_d = batch(d, step)
            ref_loss = lm_cross_entropy(ref, ref(ids_d), labels_d)
            (ref_loss / dp).backward()
            if d == dp_rank:
                ref_losses.append(float(ref_loss.detach()))
        if step == 0:
            grads, ref_grads = full_grads(model, etp), full_grads(ref, 1)
            norms = (float(grad_norm(list(model.parameters()))), float(torch.nn.utils.get_total_norm(ref_grads.values())))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    state = gather_full_state(model)
    gathered = [None] * world
    dist.all_gather_object(gathered, (losses, ref_losses, tokens, rows, norms))
    if rank == 0:
        result = {
            "losses": [g[0] for g in gathered],
            "ref_losses": [g[1] for g in gathered],
            "moe_tokens": [g[2] for g in gathered],
            "expert_rows": [g[3] for g in gathered],
            "grad_norms": [g[4] for g in gathered],  # (parallel.grad.grad_norm, one process) per rank
            "grads": grads,
            "ref_grads": ref_grads,
            "state": state,
            "ref_state": {k: v.detach().clone() for k, v in ref.named_parameters()},
            "tp_groups": layout.groups("tp"),
            "etp": etp,
            "top_k": model_config().moe.top_k,
            "tokens_per_rank": BATCH * SEQ // (tp if sp else 1),
            "saved": saved,
        }
        torch.save(result, out_dir / f"{spec}.pt")
        print(f"DONE {spec}", flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)) if want.numel() else 0.0


def run_vocab(out_dir: Path) -> None:
    """VocabParallelEmbedding against nn.Embedding (outputs, weight gradients, full table) and
    the vocab-parallel cross-entropy against F.cross_entropy, at TP 2 and TP 4, SP off and on."""
    world, rank = dist.get_world_size(), dist.get_rank()
    errors: dict[str, float] = {}
    V, H = 24, 6
    for tp in (2, 4):
        mesh = FoldedMesh.build(FoldedLayout(world, tp=tp), "cpu")
        tp_mesh, tp_rank, v = mesh.mesh("tp"), mesh.rank("tp"), V // tp
        for sp in (False, True):
            g = torch.Generator().manual_seed(tp)
            ref = torch.nn.Embedding(V, H)
            with torch.no_grad():
                ref.weight.copy_(torch.randn(V, H, generator=g))
            B, S = 2, 4 * tp
            ids = torch.randint(0, V, (B, S), generator=g)
            ids[0, :tp] = V - 1  # ids only the last rank's rows hold
            c = torch.randn(B, S, H, generator=g)
            want = ref(ids)
            (want * c).sum().backward()
            emb = VocabParallelEmbedding(ref, tp_mesh, sequence_parallel=sp)
            got = emb(ids)
            s = S // tp
            mine = slice(tp_rank * s, (tp_rank + 1) * s) if sp else slice(0, S)
            (got * c[:, mine]).sum().backward()
            name = f"tp={tp},sp={int(sp)}"
            errors[f"{name} embedding output"] = rel_err(got.detach(), want.detach()[:, mine])
            rows = slice(tp_rank * v, (tp_rank + 1) * v)
            errors[f"{name} embedding grad"] = rel_err(emb.weight.grad.to_local(), ref.weight.grad[rows])
            errors[f"{name} embedding table"] = rel_err(emb.weight.full_tensor(), ref.weight.detach())
        g = torch.Generator().manual_seed(100 + tp)
        logits = torch.randn(10, V, generator=g) * 3
        labels = torch.randint(0, V, (10,), generator=g)
        labels[::3] = -100
        full = logits.clone().requires_grad_(True)
        want = torch.nn.functional.cross_entropy(full, labels, reduction="none")
        want.sum().backward()
        local = logits[:, tp_rank * v : (tp_rank + 1) * v].clone().requires_grad_(True)
        got = vocab_parallel_cross_entropy(local, labels, mesh.group("tp"), tp_rank * v)
        got.sum().backward()
        errors[f"tp={tp} cross-entropy"] = rel_err(got.detach(), want.detach())
        errors[f"tp={tp} cross-entropy grad"] = rel_err(local.grad, full.grad[:, tp_rank * v : (tp_rank + 1) * v])
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        torch.save({"errors": gathered}, out_dir / "vocab.pt")
        print("DONE vocab", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    for i, spec in enumerate(sys.argv[2:]):
        if spec == "vocab":
            run_vocab(out)
        else:
            run(spec, out, measure_saved=i == 0)
    dist.barrier()
    dist.destroy_process_group()
