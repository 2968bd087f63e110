"""Peer MoE layers for one GPU, measured beside lightning-moe by ``benchmarks/moe_layer.py``.

Kept as the project's shared peer script (``python benchmarks/peers.py`` still runs the peers alone).

Times forward+backward of one MoE FFN layer (router + dispatch + experts + combine) for several
peers on identical shapes, bf16, and prints TFLOP/s counted on the expert GEMMs only
(18 * tokens * topk * hidden * ffn per fwd+bwd), beside a dense bf16 GEMM ceiling measured in the
same run. Usage: python peers.py [--quick] [--only NAME,...] [--json PATH]
"""
import argparse, gc, json, math, os, sys, time, traceback
import torch
import torch.nn.functional as F

SHAPES = {
    # name: tokens, hidden, ffn, experts, topk
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
    "mixtral-8x7b": (16384, 4096, 14336, 8, 2),
}
QUICK = {"tiny": (256, 64, 32, 8, 2)}


def timeit(fn, warmup=3, iters=10):
    dev = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if dev:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(iters):
            s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    else:
        ts = []
        for _ in range(iters):
            t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def dense_ceiling(dev):
    n = 8192 if dev == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = timeit(lambda: a @ b, 3, 20)
    return 2 * n ** 3 / ms / 1e9


# ---- peer 1: torch grouped_mm, sort-based permutation (the torchtitan-style reference) ----
class GroupedRef(torch.nn.Module):
    def __init__(self, H, Fh, E, k, dev):
        super().__init__()
        self.k, self.E = k, E
        self.router = torch.nn.Parameter(torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02)
        self.w13 = torch.nn.Parameter(torch.randn(E, H, 2 * Fh, device=dev, dtype=torch.bfloat16) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(E, Fh, H, device=dev, dtype=torch.bfloat16) * 0.02)

    def forward(self, x):
        T, H = x.shape
        logits = F.linear(x, self.router).float()
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        offs = counts.cumsum(0).to(torch.int32)
        tok = order // self.k
        xs = x[tok]
        h = F.grouped_mm(xs, self.w13, offs=offs)
        g, u = h.chunk(2, -1)
        y = F.grouped_mm(F.silu(g) * u, self.w2, offs=offs)
        y = y * w.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, tok, y)
        return out


def bench_module(name, mod_fn, T, H, dev, flops, results, fwd_key=None):
    torch.manual_seed(0)
    gc.collect(); torch.cuda.empty_cache() if dev == "cuda" else None
    try:
        mod = mod_fn()
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        go = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        call = fwd_key or (lambda m, x: m(x))

        def step():
            out = call(mod, x)
            out.backward(go)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = timeit(step, 2, 8)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
        r = dict(peer=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), act_peak_gib=round(peak, 2))
    except Exception as e:  # a peer that cannot run is reported, not hidden
        r = dict(peer=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
    print(json.dumps(r), flush=True)
    results.append(r)
    del_mod = None
    gc.collect()


def hf_block(H, Fh, E, k, dev, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=Fh, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True)
    cfg._experts_implementation = impl
    # Built directly on the device in bf16: a CPU fp32 init of 11 B expert weights takes minutes.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            blk = Qwen3MoeSparseMoeBlock(cfg)
    finally:
        torch.set_default_dtype(default)
    blk = blk.to(device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.02)
    return blk


class LigerPeer(torch.nn.Module):
    """HF-style softmax top-k router + Liger's Triton fused MoE experts (gather+GEMM+SwiGLU fused)."""
    def __init__(self, H, Fh, E, k, dev):
        super().__init__()
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        self.fn, self.k = LigerFusedMoEFunction, k
        self.router = torch.nn.Parameter(torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * Fh, H, device=dev, dtype=torch.bfloat16) * 0.02)
        self.down = torch.nn.Parameter(torch.randn(E, H, Fh, device=dev, dtype=torch.bfloat16) * 0.02)

    def forward(self, x):
        probs = F.linear(x, self.router).float().softmax(-1)
        w, idx = probs.topk(self.k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        return self.fn.apply(x, self.gate_up, self.down, idx.to(torch.int32), w)


def gemm_only(T, H, Fh, E, k, dev):
    """The three expert GEMMs alone on pre-permuted, balanced rows: bf16 grouped_mm vs fp8 rowwise scaled_grouped_mm (fwd only)."""
    M = T * k
    counts = torch.full((E,), M // E, device=dev)
    offs = counts.cumsum(0).to(torch.int32)
    xs = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(E, H, 2 * Fh, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, Fh, H, device=dev, dtype=torch.bfloat16) * 0.02
    fl = 6.0 * M * H * Fh
    out = {}
    def bf16():
        h = F.grouped_mm(xs, w13, offs=offs); g, u = h.chunk(2, -1); F.grouped_mm((F.silu(g) * u), w2, offs=offs)
    out["bf16_fwd_tflops"] = round(fl / timeit(bf16, 3, 10) / 1e9, 1)
    try:
        f8 = torch.float8_e4m3fn
        xq = xs.to(f8); xsc = torch.ones(M, device=dev, dtype=torch.float32)
        w13q = w13.transpose(-2, -1).contiguous().to(f8).transpose(-2, -1); w13s = torch.ones(E, 2 * Fh, device=dev)
        hq = torch.randn(M, Fh, device=dev).to(f8); hs = torch.ones(M, device=dev)
        w2q = w2.transpose(-2, -1).contiguous().to(f8).transpose(-2, -1); w2s = torch.ones(E, H, device=dev)
        def fp8():
            torch._scaled_grouped_mm(xq, w13q, xsc, w13s, offs=offs, out_dtype=torch.bfloat16)
            torch._scaled_grouped_mm(hq, w2q, hs, w2s, offs=offs, out_dtype=torch.bfloat16)
        out["fp8_rowwise_fwd_tflops"] = round(fl / timeit(fp8, 3, 10) / 1e9, 1)
    except Exception as e:
        out["fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def mcore_block(H, Fh, E, k, dev):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=16, ffn_hidden_size=Fh,
                            moe_ffn_hidden_size=Fh, num_moe_experts=E, moe_router_topk=k,
                            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bf16=True, params_dtype=torch.bfloat16, moe_grouped_gemm=False)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    with torch.device(dev):
        return spec(config=cfg).to(dev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = QUICK if a.quick else SHAPES
    if a.shapes:
        shapes = {k: v for k, v in shapes.items() if k in a.shapes.split(",")}
    only = set(a.only.split(",")) if a.only else None
    out = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__)
    out["dense_bf16_tflops"] = round(dense_ceiling(dev), 1)
    print(json.dumps(out), flush=True)
    results = []
    for sname, (T, H, Fh, E, k) in shapes.items():
        flops = 18.0 * T * k * H * Fh
        print(f"== {sname}: T={T} H={H} F={Fh} E={E} k={k} expert-GEMM GFLOP fwd+bwd={flops/1e9:.0f}", flush=True)
        peers = {
            "torch-grouped_mm-ref": lambda: GroupedRef(H, Fh, E, k, dev),
            "hf-grouped_mm": lambda: hf_block(H, Fh, E, k, dev, "grouped_mm"),
            "hf-eager-loop": lambda: hf_block(H, Fh, E, k, dev, "eager"),
            "mcore-sequential": lambda: mcore_block(H, Fh, E, k, dev),
            "liger-triton-fused": lambda: LigerPeer(H, Fh, E, k, dev),
        }
        for pname, fn in peers.items():
            if only and pname not in only:
                continue
            if pname in ("mcore-sequential", "liger-triton-fused") and dev != "cuda":
                continue
            call = None
            if pname.startswith("hf"):
                call = lambda m, x: m(x[None])[0]
            if pname.startswith("mcore"):
                call = lambda m, x: m(x[:, None, :])[0][:, 0, :]
            bench_module(pname, fn, T, H, dev, flops, results, call)
            results[-1]["shape"] = sname
        if dev == "cuda" and (not only or "gemm-only" in only):
            g = gemm_only(T, H, Fh, E, k, dev); g["shape"] = sname; g["peer"] = "gemm-only"
            print(json.dumps(g), flush=True); results.append(g)
    out["results"] = results
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print("\nshape            peer                   ms      TFLOP/s  %dense  act GiB")
    for r in results:
        if r["peer"] == "gemm-only":
            print(f"{r['shape']:16s} expert GEMMs alone, fwd: bf16 {r.get('bf16_fwd_tflops')} / fp8 {r.get('fp8_rowwise_fwd_tflops', r.get('fp8_error'))}")
        elif "error" in r:
            print(f"{r['shape']:16s} {r['peer']:20s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['shape']:16s} {r['peer']:20s} {r['ms']:8.2f} {r['tflops']:8.1f} {100*r['tflops']/out['dense_bf16_tflops']:6.1f}  {r['act_peak_gib']}")


if __name__ == "__main__":
    main()
