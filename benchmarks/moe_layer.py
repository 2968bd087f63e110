"""One MoE FFN layer, forward + backward, lightning-moe beside its peers in one process.

Protocol: bf16 parameters and activations, router in fp32, SwiGLU experts,
softmax top-k with renormalised weights, dropless; median of >= 8 timed steps after warm-up
with CUDA events; TFLOP/s on the expert GEMMs only (18*T*k*H*F per fwd+bwd); activation peak =
max_memory_allocated above the allocation before the step. Prints ratios against every peer
and a breakdown of our layer (router, permute, GEMMs, combine).

    python benchmarks/moe_layer.py                     # the three shapes of peers.SHAPES
    python benchmarks/moe_layer.py --quick             # tiny shapes (CPU smoke test)
    python benchmarks/moe_layer.py --json out.json --skew 0,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F


import peers  # noqa: E402  (the peer implementations, benchmarks/peers.py)
from gpu_clocks import ClockSampler  # noqa: E402  (benchmarks/gpu_clocks.py)
from profiling import device_kernels, step_timeline  # noqa: E402  (benchmarks/profiling.py)

from lightning_moe import MoEConfig, MoELayer, resources  # noqa: E402
from lightning_moe.config import Fp8Config, KernelConfig  # noqa: E402
from lightning_moe.ops.grouped_gemm import offsets_from_counts  # noqa: E402
from lightning_moe.ops.permute import build_permutation, permute_rows  # noqa: E402

SHAPES = peers.SHAPES
QUICK = {"tiny": (256, 64, 32, 8, 2)}


FUSED = "lightning-moe-fused-wgrad"


def ours(
    H: int, Fh: int, E: int, k: int, dev: str, skew: float, fuse_wgrad: bool = False, keep: bool = False,
    kernels: KernelConfig | None = None, fp8: Fp8Config | None = None,
) -> MoELayer:
    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=Fh,
        num_experts=E,
        top_k=k,
        score_func="softmax",
        pre_softmax=True,
        norm_topk_prob=True,
        aux_loss="none",
        fuse_wgrad_accumulation=fuse_wgrad,
        kernels=kernels or KernelConfig(),
        fp8=fp8,
    )
    with torch.device(dev):  # initialised where it runs: DeepSeek-V3's experts are 45 GB in fp32
        layer = MoELayer(cfg).to(dtype=torch.bfloat16)
    if keep:  # keep x_RH and a_RF for backward whatever the shape (default: rebuild the cheap ones)
        layer.experts.lean_backward = False
    _skew_router(layer.router.weight, skew)
    return layer


def _skew_router(weight: torch.Tensor, skew: float) -> None:
    """Skewed routing: add a shared direction to the first experts' router rows.

    With ``skew=0`` the router is random (about balanced). With ``skew=s`` the first E/8 experts
    get a row correlated with the mean input direction, so they win most top-k slots.
    """
    if skew <= 0:
        return
    with torch.no_grad():
        g = torch.Generator(device="cpu").manual_seed(7)
        direction = torch.randn(weight.shape[1], generator=g).to(weight.device, weight.dtype)
        hot = max(weight.shape[0] // 8, 1)
        weight[:hot] += skew * 0.02 * direction


def skewed_input(T: int, H: int, dev: str, skew: float) -> torch.Tensor:
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    if skew > 0:
        g = torch.Generator(device="cpu").manual_seed(7)
        direction = torch.randn(H, generator=g).to(dev, torch.bfloat16)
        x = x + direction
    return x


FRESH_GRADS = False  # --fresh-grads: every gradient starts at None each step (no accumulation)


def bench(name, make, T, H, dev, flops, skew, call=None) -> dict:  # noqa: ANN001
    """Time fwd+bwd of one module on the same inputs as every peer.

    By default gradients accumulate over the timed steps (the shared protocol: the weights' and the
    input's ``.grad`` are added into each step); with ``--fresh-grads`` each step starts with every
    ``.grad`` at ``None``, as a training step without gradient accumulation does (Lightning's
    ``zero_grad(set_to_none=True)``), so a step writes its gradients as the GEMMs alone write theirs."""
    torch.manual_seed(0)
    if dev == "cuda":
        torch.cuda.empty_cache()
    try:
        mod = make()
        x = skewed_input(T, H, dev, skew).requires_grad_(True)
        go = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        fwd = call or (lambda m, x: m(x))

        params = list(mod.parameters())

        def step() -> None:
            if FRESH_GRADS:
                x.grad = None
                for p in params:
                    p.grad = None
            fwd(mod, x).backward(go)

        step()  # first call: kernel build/load and grads allocated, before the baseline
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with ClockSampler() as clocks:  # SM clock, power, clock-event reason over the timed steps (nvidia-smi)
            ms = peers.timeit(step, 2, 10)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
        r = dict(peer=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 4), act_peak_gib=round(peak, 2))
        r.update(clocks.summary())
        del mod
    except Exception as e:  # a peer that cannot run is reported, not hidden
        r = dict(peer=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(r), flush=True)
    return r


def breakdown(T: int, H: int, Fh: int, E: int, k: int, dev: str, skew: float, fuse_wgrad: bool = False) -> dict:
    """Where our layer's time goes: CUDA time per kernel over one fwd+bwd step (profiler)."""
    layer = ours(H, Fh, E, k, dev, skew, fuse_wgrad=fuse_wgrad)
    x = skewed_input(T, H, dev, skew).requires_grad_(True)
    go = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        layer(x).backward(go)
    out: dict = {}
    if dev == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer(x).backward(go)
            torch.cuda.synchronize()
        rows = [(k["total_ms"] / 3, k["count"] // 3, k["name"][:110]) for k in device_kernels(prof)]
        out["kernels_ms"] = [[round(ms, 3), n, name] for ms, n, name in rows[:22]]
        out["total_kernel_ms"] = round(sum(r[0] for r in rows), 3)
        out["timeline"] = _timeline(lambda: layer(x).backward(go))
        out["host_syncs"] = _host_syncs(lambda: layer(x).backward(go))
        out["host_ms"] = round(_host_time(lambda: layer(x).backward(go)), 3)
    with torch.no_grad():
        routing = layer.router(x)
    perm = build_permutation(routing.topk_ids_TK, E, dropless=True)
    x_RH = permute_rows(x.detach(), perm)
    offs = offsets_from_counts(perm.tokens_per_expert_E)
    out["gemms_fwd_bwd_alone"] = gemms_alone(x_RH, layer.experts.w13.detach(), layer.experts.w2.detach(), offs, Fh)
    return out


def _timeline(step) -> dict:  # noqa: ANN001
    """One step's GPU timeline (``profiling.step_timeline``): idle time and who the device waits for."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):  # the first step under a new profiler pays its start-up: the last one is read
            with record_function("step"):
                step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return step_timeline(path)


def _host_syncs(step) -> list[str]:  # noqa: ANN001
    """Where one step makes the host wait for the device (torch's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]


def _host_time(step) -> float:  # noqa: ANN001
    """Host-side ms of one step's launches (no sync inside): near the GPU time means launch-bound."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3


def gemm_operands(x_RH: torch.Tensor, Fh: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random stand-ins for the step's other GEMM operands: a_RF, h_R2F and the rows' gradient g_RH."""
    M, H = x_RH.shape
    return (
        torch.randn(M, Fh, device=x_RH.device, dtype=x_RH.dtype),
        torch.randn(M, 2 * Fh, device=x_RH.device, dtype=x_RH.dtype),
        torch.randn(M, H, device=x_RH.device, dtype=x_RH.dtype),
    )


def gemm_steps(
    x_RH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, Fh: int, operands: tuple | None = None
) -> dict:
    """The six grouped GEMMs of fwd+bwd as callables (this routing's real group sizes; ``operands``:
    (a_RF, h_R2F, g_RH), random by default): ``fwd``, ``bwd`` (data and weight gradients), ``wgrad``
    (x^T dy), ``wgrad_transposed`` (dy^T x), ``all``."""
    a_RF, h_R2F, g_RH = operands if operands is not None else gemm_operands(x_RH, Fh)

    def fwd() -> None:
        F.grouped_mm(x_RH, w13, offs=offs)
        F.grouped_mm(a_RF, w2, offs=offs)

    def bwd() -> None:
        F.grouped_mm(g_RH, w2.transpose(1, 2), offs=offs)
        F.grouped_mm(a_RF.t(), g_RH, offs=offs)
        F.grouped_mm(h_R2F, w13.transpose(1, 2), offs=offs)
        F.grouped_mm(x_RH.t(), h_R2F, offs=offs)

    def wgrad() -> None:  # the two weight-gradient GEMMs as the layer runs them: x^T @ dy
        F.grouped_mm(a_RF.t(), g_RH, offs=offs)
        F.grouped_mm(x_RH.t(), h_R2F, offs=offs)

    def wgrad_transposed() -> None:  # the same products as dy^T @ x (weights' transpose layout)
        F.grouped_mm(g_RH.t(), a_RF, offs=offs)
        F.grouped_mm(h_R2F.t(), x_RH, offs=offs)

    def both() -> None:
        fwd()
        bwd()

    return {"fwd": fwd, "bwd": bwd, "wgrad": wgrad, "wgrad_transposed": wgrad_transposed, "all": both}


def gemms_alone(x_RH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, Fh: int) -> dict:
    """The six grouped GEMMs of fwd+bwd, nothing else (this routing's real group sizes)."""
    M, H = x_RH.shape
    steps = gemm_steps(x_RH, w13, w2, offs, Fh)
    fwd, bwd, wgrad, wgrad_transposed = steps["fwd"], steps["bwd"], steps["wgrad"], steps["wgrad_transposed"]

    f_ms, b_ms = peers.timeit(fwd, 3, 10), peers.timeit(bwd, 3, 10)
    return {
        "wgrad_ms": round(peers.timeit(wgrad, 3, 10), 3),
        "wgrad_transposed_ms": round(peers.timeit(wgrad_transposed, 3, 10), 3),
        "fwd_ms": round(f_ms, 3),
        "bwd_ms": round(b_ms, 3),
        "fwd_tflops": round(6.0 * M * H * Fh / f_ms / 1e9, 1),
        "fwd_bwd_tflops": round(18.0 * M * H * Fh / (f_ms + b_ms) / 1e9, 1),
    }


def peer_makers(H: int, Fh: int, E: int, k: int, dev: str) -> dict:
    return {
        "torch-grouped_mm-ref": (lambda: peers.GroupedRef(H, Fh, E, k, dev), None),
        "hf-grouped_mm": (lambda: peers.hf_block(H, Fh, E, k, dev, "grouped_mm"), _hf_call),
        "hf-eager-loop": (lambda: peers.hf_block(H, Fh, E, k, dev, "eager"), _hf_call),
        "liger-triton-fused": (lambda: peers.LigerPeer(H, Fh, E, k, dev), None),
        "mcore-sequential": (lambda: peers.mcore_block(H, Fh, E, k, dev), _mcore_call),
    }


@contextlib.contextmanager
def environment(settings: dict[str, str | None]):  # noqa: ANN201
    """The environment variables set to ``settings`` (``None``: left as they are), restored after."""
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if value is not None:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _hf_call(m, x):  # noqa: ANN001, ANN202
    out = m(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _mcore_call(m, x):  # noqa: ANN001, ANN202
    return m(x[:, None, :])[0][:, 0, :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--peers", default="", help="comma list; default all")
    ap.add_argument("--skew", default="0", help="comma list of router skews (0 = balanced)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--fresh-grads", action="store_true",
                    help="every .grad set to None before each step (no accumulation), for every peer")
    ap.add_argument("--json", default="")
    ap.add_argument("--fuse-wgrad", action="store_true",
                    help="also run lightning-moe with MoEConfig(fuse_wgrad_accumulation=True) (row lightning-moe-fused-wgrad)")
    ap.add_argument("--fuse-wgrad-keep", action="store_true",
                    help=f"also run it keeping x_RH and a_RF for backward (row {FUSED}-keep)")
    ap.add_argument("--fuse-wgrad-kernels", default="",
                    help=f"comma list of KernelConfig.wgrad values: one more {FUSED} row each, "
                    "in the same process (rows named like lightning-moe-fused-wgrad[streams])")
    a = ap.parse_args()
    global FRESH_GRADS
    FRESH_GRADS = a.fresh_grads
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = QUICK if a.quick else SHAPES
    if a.shapes:
        shapes = {n: s for n, s in shapes.items() if n in a.shapes.split(",")}
    only = set(a.peers.split(",")) if a.peers else None
    skews = [float(s) for s in a.skew.split(",")]
    out = dict(
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        torch=torch.__version__,
        kernels=resources.kernels_mode(),
    )
    out["dense_bf16_tflops"] = round(peers.dense_ceiling(dev), 1)
    print(json.dumps(out), flush=True)
    results = []
    for sname, (T, H, Fh, E, k) in shapes.items():
        flops = 18.0 * T * k * H * Fh
        for skew in skews:
            tag = f"{sname}" + (f"/skew{skew:g}" if skew else "")
            print(f"== {tag}: T={T} H={H} F={Fh} E={E} k={k}", flush=True)
            r = bench("lightning-moe", lambda: ours(H, Fh, E, k, dev, skew), T, H, dev, flops, skew)
            r["shape"] = tag
            results.append(r)
            for wanted, name, keep in ((a.fuse_wgrad, FUSED, False), (a.fuse_wgrad_keep, FUSED + "-keep", True)):
                if wanted:
                    make = lambda keep=keep: ours(H, Fh, E, k, dev, skew, fuse_wgrad=True, keep=keep)  # noqa: E731
                    r = bench(name, make, T, H, dev, flops, skew)
                    r["shape"] = tag
                    results.append(r)
            for kernel in filter(None, a.fuse_wgrad_kernels.split(",")):
                kernels = KernelConfig(wgrad=kernel)  # type: ignore[arg-type]
                make = lambda kernels=kernels: ours(H, Fh, E, k, dev, skew, fuse_wgrad=True, kernels=kernels)  # noqa: E731
                r = bench(f"{FUSED}[{kernel}]", make, T, H, dev, flops, skew)
                r["shape"] = tag
                results.append(r)
            for pname, (make, call) in peer_makers(H, Fh, E, k, dev).items():
                if (only and pname not in only) or (pname in ("mcore-sequential", "liger-triton-fused") and dev != "cuda"):
                    continue
                if skew and pname not in ("torch-grouped_mm-ref", "hf-grouped_mm"):
                    continue
                if pname == "hf-eager-loop" and T * k * H * Fh > 2e11:
                    r = dict(peer=pname, shape=tag, error="skipped: a per-expert Python loop runs > 2 s a step here")
                    print(json.dumps(r), flush=True)
                    results.append(r)
                    continue
                make = _with_skew(make, skew)
                r = bench(pname, make, T, H, dev, flops, skew, call)
                r["shape"] = tag
                results.append(r)
            if not a.no_breakdown:
                b = breakdown(T, H, Fh, E, k, dev, skew, fuse_wgrad=a.fuse_wgrad)
                b.update(shape=tag, peer="breakdown")
                print(json.dumps(b), flush=True)
                results.append(b)
            if dev == "cuda" and not skew:
                g = peers.gemm_only(T, H, Fh, E, k, dev)
                g.update(shape=tag, peer="gemm-only")
                print(json.dumps(g), flush=True)
                results.append(g)
    out["results"] = results
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print_table(out)


def _with_skew(make, skew):  # noqa: ANN001, ANN202
    """Apply the same router skew to a peer's router weight (balanced: unchanged)."""

    def built():  # noqa: ANN202
        mod = make()
        if skew:
            router = getattr(mod, "router", None)
            if router is None:
                router = mod.gate.weight  # HF block
            _skew_router(router, skew)
        return mod

    return built


def print_table(out: dict) -> None:
    print(f"\ndevice {out['device']}  torch {out['torch']}  dense bf16 {out['dense_bf16_tflops']} TFLOP/s")
    print(f"{'shape':24s} {'peer':22s} {'ms':>8s} {'TFLOP/s':>8s} {'act GiB':>8s} {'ours/peer':>9s}")
    by_shape: dict[str, dict] = {}
    for r in out["results"]:
        by_shape.setdefault(r["shape"], {})[r["peer"]] = r
    for shape, rows in by_shape.items():
        mine = rows.get("lightning-moe", {})
        for name, r in rows.items():
            if name == "gemm-only":
                print(f"{shape:24s} GEMMs alone fwd: {r.get('bf16_fwd_tflops')} TFLOP/s")
            elif name == "breakdown":
                g = r["gemms_fwd_bwd_alone"]
                gms = g["fwd_ms"] + g["bwd_ms"]
                ours_ms = {n: rows[n]["ms"] for n in rows if n.startswith("lightning-moe") and rows[n].get("ms")}
                over = ", ".join(f"{n} {100 * (ms / gms - 1):+.1f} %" for n, ms in ours_ms.items()) or "n/a"
                print(
                    f"{shape:24s} GEMMs alone fwd+bwd {gms:.2f} ms = {g['fwd_bwd_tflops']} TFLOP/s "
                    f"(fwd {g['fwd_tflops']}); whole layer over them: {over}; "
                    f"kernel time {r.get('total_kernel_ms')} ms; wgrad GEMMs {g.get('wgrad_ms')} ms "
                    f"(as dy^T x: {g.get('wgrad_transposed_ms')} ms)"
                )
                print(f"{'':26s}host time of one step's launches {r.get('host_ms')} ms; "
                      f"host syncs: {len(r.get('host_syncs', []))} {r.get('host_syncs', [])[:3]}")
                t = r.get("timeline") or {}
                if t:
                    ops = t.get("host_ops_before_first_long", [])
                    print(f"{'':26s}timeline (profiled): span {t['span_ms']:.3f} ms, device idle {t['idle_ms']:.3f} ms; "
                          f"first long kernel at {t.get('first_long_start_ms', float('nan')):.3f} ms (launched at "
                          f"{t.get('first_long_launch_ms', float('nan')):.3f} ms after {len(ops)} host ops: "
                          f"{', '.join(f'{n} {ms}' for n, ms in ops[:40])})")
                    for gap, before, after in t.get("gaps", []):
                        print(f"{'':26s}  idle {gap:.3f} ms between {before} | {after}")
                for ms, n, kname in r.get("kernels_ms", [])[:12]:
                    print(f"{'':26s}{ms:8.3f} ms x{n:<3d} {kname}")
            elif "error" in r:
                print(f"{shape:24s} {name:22s} ERROR {r['error'][:90]}")
            else:
                ratio = r["ms"] / mine["ms"] if mine.get("ms") else float("nan")
                clocks = f"  {r['sm_mhz']} MHz {r['power_w']} W {r['clock_reason']}" if "sm_mhz" in r else ""
                print(f"{shape:24s} {name:22s} {r['ms']:8.2f} {r['tflops']:8.1f} {r['act_peak_gib']:8.2f} {ratio:9.2f}{clocks}")
        fused = rows.get(FUSED, {})
        if fused.get("ms"):
            ratios = ", ".join(
                f"{n} {r['ms'] / fused['ms']:.2f}x" for n, r in rows.items() if r.get("ms") and n != FUSED
            )
            print(f"{shape:24s} peer ms / {FUSED} ms: {ratios}")


if __name__ == "__main__":
    main()
