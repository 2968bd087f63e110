"""Worker: context-parallel attention and the transformer under CP, against one process.

Run by ``test_dist_context.py`` on 4 gloo ranks. Every rank builds the same global inputs from one
seed, computes the one-process result on the whole sequence, then runs its shard through the CP
path and checks its part of the output and of the gradients. CP=4 uses all ranks; CP=2 runs as two
groups ([0, 1] and [2, 3]) at once. Rank 0 prints ``OK <check>`` for each check every rank passed.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_moe import MoEConfig
from lightning_moe.models import MoETransformer, TransformerConfig
from lightning_moe.models.context_parallel import enable_context_parallel
from lightning_moe.models.transformer import document_positions
from lightning_moe.parallel.context import (
    context_parallel_attention,
    cp_chunk_positions,
    shard_sequence,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _saved_bytes import saved_bytes  # noqa: E402  (tests/unit/_saved_bytes.py)

S, D = 32, 8
DOCS = torch.tensor([[0] * 5 + [1] * 14 + [2] * 1 + [3] * 12, [4] * 32])  # documents cross every chunk boundary


def reference(q, k, v, docs):  # noqa: ANN001, ANN201
    """Causal (same-document) softmax attention over the whole sequence, written out."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if docs is not None:
        keep = keep & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep[:, None], float("-inf"))
    return scores.softmax(-1) @ v


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{name}: max abs diff {(got - want).abs().max().item():.3e}")


def report(name: str) -> None:
    dist.barrier()  # every rank got here: its checks passed
    if dist.get_rank() == 0:
        print(f"OK {name}", flush=True)


def cp_groups(cp: int) -> tuple[dist.ProcessGroup, int]:
    """This rank's CP group of size ``cp`` (consecutive ranks) and its rank in it."""
    mine = None
    for start in range(0, dist.get_world_size(), cp):
        ranks = list(range(start, start + cp))
        group = dist.new_group(ranks)  # every rank makes every group, in the same order
        if dist.get_rank() in ranks:
            mine = group
    return mine, dist.get_rank() % cp


def attention_case(cp: int, group: dist.ProcessGroup, r: int, b: int, n: int, nk: int, docs_on: bool, restart: bool) -> None:
    g = torch.Generator().manual_seed(1000 * cp + 10 * n + nk + b)
    q = torch.randn(b, n, S, D, generator=g) * 2
    k = torch.randn(b, nk, S, D, generator=g) * 2
    v = torch.randn(b, nk, S, D, generator=g)
    c = torch.randn(b, n, S, D, generator=g)
    docs = DOCS[:b] if docs_on else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_out = reference(*leaves, docs)
    want = [want_out, *torch.autograd.grad((want_out * c).sum(), leaves)]

    pos_BS = document_positions(docs) if restart else torch.arange(S).expand(b, S)
    local = [shard_sequence(t, cp, r, dim=2).requires_grad_(True) for t in (q, k, v)]
    pos = shard_sequence(pos_BS, cp, r, dim=1)
    if not restart and b:
        pos = pos[0]  # the [s] form
    doc_local = None if docs is None else shard_sequence(docs, cp, r, dim=1)
    out = context_parallel_attention(*local, pos, group, doc_local)
    grads = torch.autograd.grad((out * shard_sequence(c, cp, r, dim=2)).sum(), local)
    label = f"cp={cp} b={b} heads={n}/{nk} docs={docs_on} restart={restart}"
    for name, got, w in zip(("out", "dq", "dk", "dv"), [out, *grads], want):
        check(f"{label} {name}", got, shard_sequence(w, cp, r, dim=2))


def model_case(cp: int, group: dist.ProcessGroup, r: int, docs_on: bool) -> None:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss_coeff=0.0)
    cfg = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, moe=moe)
    torch.manual_seed(7)
    ref = MoETransformer(cfg)
    model = copy.deepcopy(ref)
    enable_context_parallel(model, group)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (2, S), generator=g)
    c = torch.randn(2, S, 64, generator=g)
    docs = DOCS if docs_on else None
    pos = document_positions(DOCS) if docs_on else torch.arange(S).expand(2, S)
    want = ref(ids, document_ids_BS=docs)
    (want * c).sum().backward()

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, r, dim=1)

    got = model(shard(ids), shard(pos), None if docs is None else shard(docs))
    (got * shard(c)).sum().backward()
    label = f"model cp={cp} docs={docs_on}"
    check(f"{label} logits", got, shard(want.detach()))
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank's grads are those of its tokens' losses
        check(f"{label} grad {name}", grad, p_ref.grad)


def memory_case(group: dist.ProcessGroup, r: int, seq: int = 1024) -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, seq, 16, generator=g).requires_grad_(True) for _ in range(3))
    cp1 = saved_bytes(lambda *t: context_parallel_attention(*t, torch.arange(seq), None), q, k, v)
    pos = cp_chunk_positions(seq, 4, r)
    local = [t.detach()[:, :, pos].requires_grad_(True) for t in (q, k, v)]
    cp4 = saved_bytes(lambda *t: context_parallel_attention(*t, pos, group), *local)
    if cp4 > 0.35 * cp1:
        raise AssertionError(f"CP4 keeps {cp4} bytes for backward, more than 0.35 x CP1's {cp1}")
    if dist.get_rank() == 0:
        print(f"saved bytes S={seq}: cp1={cp1} cp4={cp4} ratio={cp4 / cp1:.3f}", flush=True)


def bad_documents_case(group: dist.ProcessGroup, r: int) -> None:
    """Document ids that decrease inside rank 1's chunk only: every rank of the group raises."""
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=2, top_k=2, aux_loss_coeff=0.0)
    cfg = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, moe=moe)
    model = MoETransformer(cfg)
    enable_context_parallel(model, group)
    docs = torch.tensor([[0] * 8 + [2] * 4 + [1] * 4])  # on cp=2, positions 8..11 sit on rank 1
    ids = torch.zeros(1, 16, dtype=torch.long)
    shard = lambda t: shard_sequence(t, 2, r, dim=1)  # noqa: E731
    try:
        model(shard(ids), shard(document_positions(docs)), shard(docs))
    except ValueError as err:
        if "document_ids_BS decrease in row 0 at token 12 (2 -> 1)" not in str(err):
            raise
    else:
        raise AssertionError("decreasing document ids were accepted")


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    start = time.time()
    if dist.get_world_size() != 4:
        raise SystemExit("worker_context.py runs on 4 ranks")
    group4, r4 = cp_groups(4)
    group2, r2 = cp_groups(2)
    for cp, group, r in ((2, group2, r2), (4, group4, r4)):
        for b, n, nk, docs_on, restart in (
            (2, 4, 2, False, False),
            (2, 4, 2, True, False),
            (2, 4, 2, True, True),
            (2, 2, 2, True, True),
            (2, 4, 1, False, False),
            (0, 4, 2, True, True),
        ):
            attention_case(cp, group, r, b, n, nk, docs_on, restart)
        report(f"attention cp={cp}")
    for docs_on in (False, True):
        model_case(2, group2, r2, docs_on)
    report("model cp=2")
    memory_case(group4, r4)
    report("memory cp=4")
    bad_documents_case(group2, r2)
    report("bad documents cp=2")
    if dist.get_rank() == 0:
        print(f"ALL OK {time.time() - start:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
