"""What the non-finite guard costs: one training step of ``configs/tiny_moe.yaml``'s model with and without it.

``python benchmarks/probes/nonfinite_guard.py [--steps 20] [--rounds 5]``: forward, backward,
:func:`~lightning_moe.parallel.finite.find_nonfinite` (guard arm only), mesh-aware norm clipping
and AdamW on a 16 x 128 byte-token batch, one process, fp32, on this machine's CPU. The two arms
alternate round by round (a loaded machine slows both alike); prints the median step time of each,
their ratio, and the guard call alone timed on the same gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_moe.config import MoEConfig
from lightning_moe.models.transformer import MoETransformer, TransformerConfig
from lightning_moe.parallel.finite import find_nonfinite
from lightning_moe.parallel.grad import clip_grad_norm_

__all__ = ["main"]


def _model() -> MoETransformer:
    moe = MoEConfig(
        hidden_size=128, ffn_hidden_size=128, num_experts=8, top_k=2, score_func="softmax", pre_softmax=True,
        norm_topk_prob=True, aux_loss="switch", aux_loss_coeff=0.01, z_loss_coeff=0.001, shared_expert_ffn_size=128,
        check_finite=True,
    )  # fmt: skip
    cfg = TransformerConfig(
        vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_dense_layers=1, dense_ffn_hidden_size=256,
        max_seq_len=256, moe=moe,
    )  # fmt: skip
    return MoETransformer(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (16, 129))
    cpu = torch.device("cpu")

    def step(guard: bool) -> float:
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if guard and find_nonfinite(model, loss, None, cpu) is not None:
            raise FloatingPointError("non-finite step in the probe")
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        step(True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for guard in (False, True):
            times[guard] += [step(guard) for _ in range(args.steps)]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    calls = []
    for _ in range(200):
        t0 = time.perf_counter()
        find_nonfinite(model, None, None, cpu)
        calls.append(time.perf_counter() - t0)
    params = sum(1 for p in model.parameters() if p.grad is not None)
    print(f"threads={torch.get_num_threads()} parameters_with_grad={params}")
    print(f"step median: guard off {off * 1e3:.2f} ms, guard on {on * 1e3:.2f} ms, ratio {on / off:.4f}")
    print(f"find_nonfinite alone: median {statistics.median(calls) * 1e6:.0f} us ({statistics.median(calls) / off:.2%} of a step)")


if __name__ == "__main__":
    main()
