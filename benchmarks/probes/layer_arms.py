"""lightning-moe's layer step under several kernel settings, interleaved in one process.

On one H200 the layer step holds the chip at its power cap (``benchmarks/probes/clock_probe.py``), so a
kernel raced alone, at whatever clock its own power allows, can rank differently inside the step,
where the bandwidth-bound kernels around it draw less. This times the fused-wgrad layer step
(synchronised, CUDA events, as ``benchmarks/moe_layer.py``) under each arm's kernel
settings, a few steps of each arm in turn for several rounds, so clock drift falls on all alike.

An arm is ``label:NAME=VALUE+NAME=VALUE`` (fields of ``KernelConfig``: ``gemm``,
``gemm_cutlass_tile``, ``wgrad``, ``wgrad_streams_w13``, ``wgrad_streams_w2``; set on the built
layer's experts for the arm's steps, as the layer would have read them at construction); a label starting with
``fresh`` (or ending with ``@fresh``) also sets every parameter's ``.grad`` to ``None`` before each
step (no accumulation).

The label ``gemms-alone`` times the six grouped GEMMs of the step alone (``moe_layer.gemm_steps``,
this routing's group sizes) in the same rounds: the comparator of "within 15 % of the GEMMs".

What-if labels (timing only: the step's results are wrong): ``no-bwd-scatter``, ``no-gather-sums``,
``no-swiglu`` (``-fwd``, ``-bwd``: one of the two) and ``no-bandwidth`` (all three) replace those bandwidth-bound kernels of the fused
experts (``ops/local_experts.py``: the backward's scatter of dy to the rows, the forward and
backward gather-sums, the weighted SwiGLU forward and backward) by their first real result, kept
and handed out again: what the step would cost at the power cap if a fusion made them free — the
upper bound of what moving them into the GEMMs can buy. (The forward's scatter of x runs inside
the one-call router and stays; it moves as many bytes as the backward's.)

Floor labels (timing only) emulate the best a fused design on this GPU can do, bytes it cannot
avoid included: ``floor`` makes the backward's dy scatter free (as an operand gather in the GEMMs'
loads would), and runs, instead of the weighted SwiGLU, only the traffic its fusion into the GEMM
epilogues keeps: forward, the up-projection's epilogue writing ``a_RF`` beside ``h`` (a write of
R·F values); backward, the down-projection's data-gradient epilogue reading ``h`` and writing
``grad_h`` where it wrote ``grad_a`` (R·2F read, R·F more written). The gather-sums (the sum over
each token's K rows) stay: without atomics no GEMM epilogue can do them. ``floor-atomic`` makes
them free as well. The forward's x scatter stays in both (inside the one-call router; the dy
scatter's removal, the same bytes, is measured by ``no-bwd-scatter``). ``router-ops`` turns the
one-call router off: the separate router, permutation and scatter calls (the host path it saves).

    PYTHONPATH=benchmarks python3 benchmarks/probes/layer_arms.py --shape qwen3-30b-a3b \\
        --arms "default:,gemm-coop:gemm=cutlass+gemm_cutlass_tile=cooperative-128x256-c2x1"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

import peers  # noqa: E402  (benchmarks/peers.py: shapes)
from gpu_clocks import ClockSampler  # noqa: E402
from moe_layer import gemm_steps, ours, skewed_input  # noqa: E402

from lightning_moe.config import KernelConfig  # noqa: E402

from lightning_moe.ops.grouped_gemm import offsets_from_counts  # noqa: E402
from lightning_moe.ops.permute import build_permutation, permute_rows  # noqa: E402


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    label, _, settings = spec.partition(":")
    env = {}
    for item in filter(None, settings.split("+")):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"arm {spec!r}: setting {item!r} is not NAME=VALUE")
        env[name.strip()] = value.strip()
    return label.strip(), env


@contextlib.contextmanager
def kernel_settings(layer, settings: dict[str, str]):  # noqa: ANN001, ANN201
    """The layer's experts run ``KernelConfig(**settings)`` (validated) inside, their own choice after."""
    fields = {n: int(v) if n.startswith("wgrad_streams") else v for n, v in settings.items()}
    try:
        kernels = KernelConfig(**fields)
    except TypeError as err:
        raise SystemExit(f"--arms: {err}; an arm sets KernelConfig fields (gemm, gemm_cutlass_tile, wgrad, ...)") from None
    experts = layer.experts
    names = ("gemm_kernel", "gemm_tile", "wgrad_kernel", "wgrad_streams")
    before = [getattr(experts, n) for n in names]
    values = (kernels.gemm, kernels.gemm_cutlass_tile, kernels.wgrad, (kernels.wgrad_streams_w13, kernels.wgrad_streams_w2))
    for name, value in zip(names, values):
        setattr(experts, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, before):
            setattr(experts, name, value)


_SKIPPABLE = {
    "no-bwd-scatter": ("_expert_rows_impl",),
    "no-gather-sums": ("_unpermute_sum_impl",),
    "no-swiglu": ("weighted_swiglu_forward", "weighted_swiglu_backward"),
    "no-swiglu-fwd": ("weighted_swiglu_forward",),
    "no-swiglu-bwd": ("weighted_swiglu_backward",),
    "no-bandwidth": ("_expert_rows_impl", "_unpermute_sum_impl", "weighted_swiglu_forward", "weighted_swiglu_backward"),
    "floor": ("_expert_rows_impl", "weighted_swiglu_forward", "weighted_swiglu_backward"),  # dy scatter: x's is in the router
    "floor-atomic": ("_expert_rows_impl", "_unpermute_sum_impl", "weighted_swiglu_forward", "weighted_swiglu_backward"),
}
_ROUTER_OFF = ("router-ops",)


def _swiglu_forward_kept_traffic(h_R2F: torch.Tensor, *_: object) -> None:
    """What SwiGLU in the up-projection's epilogue still moves: its store of ``a_RF`` (R·F values)."""
    torch.empty((h_R2F.shape[0], h_R2F.shape[1] // 2), dtype=h_R2F.dtype, device=h_R2F.device).fill_(1.0)


def _swiglu_backward_kept_traffic(h_R2F: torch.Tensor, *_: object) -> None:
    """What SwiGLU's backward in the data-gradient epilogue still moves: ``h`` read, R·F more written."""
    Fh = h_R2F.shape[1] // 2
    torch.add(h_R2F[:, :Fh], h_R2F[:, Fh:])


# Floor labels: what a skipped op's fusion would still cost, run before its kept result is handed out.
_KEPT_TRAFFIC = {
    "weighted_swiglu_forward": _swiglu_forward_kept_traffic,
    "weighted_swiglu_backward": _swiglu_backward_kept_traffic,
}


@contextlib.contextmanager
def skipped(label: str):  # noqa: ANN201
    """For a what-if label: the named ops of ``ops/local_experts.py`` replaced by their first result."""
    import lightning_moe.ops.local_experts as local_ops

    from lightning_moe.moe.router import TopKRouter

    base = label.split("@")[0]
    names = _SKIPPABLE.get(base, ())
    floor = base.startswith("floor")
    originals = {name: getattr(local_ops, name) for name in names}

    def kept(name, fn):  # noqa: ANN001, ANN202
        cache: dict = {}
        traffic = _KEPT_TRAFFIC.get(name) if floor else None

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            key = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            if key not in cache:
                cache[key] = fn(*args, **kwargs)
            elif traffic is not None:
                traffic(*args)
            return cache[key]

        return call

    for name, fn in originals.items():
        setattr(local_ops, name, kept(name, fn))
    one_call = TopKRouter.route_and_permute
    if base in _ROUTER_OFF:
        TopKRouter.route_and_permute = lambda self, x_TH: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        TopKRouter.route_and_permute = one_call  # type: ignore[method-assign]
        for name, fn in originals.items():
            setattr(local_ops, name, fn)


def run(shape: str, specs: list[str], rounds: int, steps: int) -> list[dict]:
    T, H, Fh, E, k = peers.SHAPES[shape]
    layer = ours(H, Fh, E, k, "cuda", 0.0, fuse_wgrad=True)
    x = skewed_input(T, H, "cuda", 0.0).requires_grad_(True)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    arms = [parse_arm(s) for s in specs]
    gemms = None
    if any(label == "gemms-alone" for label, _ in arms):
        with torch.no_grad():
            perm = build_permutation(layer.router(x).topk_ids_TK, E, dropless=True)
        x_RH = permute_rows(x.detach(), perm)
        offs = offsets_from_counts(perm.tokens_per_expert_E)
        gemms = gemm_steps(x_RH, layer.experts.w13.detach(), layer.experts.w2.detach(), offs, Fh)["all"]
    times: dict[str, list[float]] = {label: [] for label, _ in arms}
    windows: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in arms}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ClockSampler() as clocks:
        for _ in range(rounds):
            for label, env in arms:
                with kernel_settings(layer, env), skipped(label):
                    for i in range(steps + 2):  # two warm-up steps after switching
                        if label.startswith("fresh") or label.endswith("@fresh"):
                            for p in layer.parameters():
                                p.grad = None
                        x.grad = None
                        t0 = time.time()
                        s.record()
                        if label == "gemms-alone":
                            gemms()
                        else:
                            layer(x).backward(go)
                        e.record()
                        torch.cuda.synchronize()
                        if i >= 2:
                            times[label].append(s.elapsed_time(e))
                            windows[label].append((t0, time.time()))
    base = statistics.median(times[arms[0][0]])
    rows = []
    for label, env in arms:
        ms = statistics.median(times[label])
        inside = [smp for t0, t1 in windows[label] for smp in clocks.window(t0, t1)]
        row = {"shape": shape, "arm": label, "ms": round(ms, 3), "vs_first": round(ms / base, 3), "env": env}
        if inside:
            row["sm_mhz"] = round(statistics.median(smp[1] for smp in inside))
            row["power_w"] = round(statistics.median(smp[2] for smp in inside))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(peers.SHAPES))
    ap.add_argument("--arms", required=True, help="comma-separated label:NAME=VALUE+NAME=VALUE")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = run(a.shape, [s for s in a.arms.split(",") if s.strip()], a.rounds, a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
