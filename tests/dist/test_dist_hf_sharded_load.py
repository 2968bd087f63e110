"""An HF checkpoint loads onto meta-initialised folded_moe ranks, each rank reading its own slices.

4 gloo ranks. A small Qwen3-MoE checkpoint (fp32) gives the one-process HF model's logits at EP4,
at EP2 x EDP2 (experts FSDP-sharded on H, dense weights over 4), TP2 x ETP2 x EP2 and TP2 x ETP2
x EDP2, and streams
back out bit for bit (from the loaded model, and from the DCP folder the Trainer saves). In the same
job it and a small DeepSeek-V3 checkpoint (MLA, a dense first layer, a shared expert, grouped
sigmoid routing with its correction bias) load at PP2 x EP2 (1f1b), each pipeline rank reading only
its stages' tensors and its EP rank's experts: every local parameter and buffer equals the
one-process model's bit for bit, and the validation loss and one training step's loss equal the
pp=1 load's (rtol 1e-5). A synthetic 1.53 B-parameter Qwen3-MoE checkpoint (random bf16 weights, about 3.1 GB, written
tensor by tensor into 256 MB shards, so the test never holds the model) loads at EP4 with each
rank's peak RSS under ``(dense + experts / 4) * 1.3`` plus its resident size before the load and a
fixed 256 MB; after that measurement the loaded, EP4-distributed model's fp32 logits equal
transformers' ``from_pretrained`` of the same checkpoint to 1e-4 (the worker's ``LOGITS_RTOL``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from _harness import run_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

SMALL = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
}  # fmt: skip
# MLA with a q LoRA, layer 0 dense and layer 1 MoE (so each PP2 stage holds one), a shared expert
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "tie_word_embeddings": False,
}  # fmt: skip
# 14 layers x 64 experts x 3 x 1024 x 512 = 1.41 B expert + 0.12 B dense parameters
LARGE = {
    "model_type": "qwen3_moe", "vocab_size": 40000, "hidden_size": 1024, "intermediate_size": 2048,
    "moe_intermediate_size": 512, "num_hidden_layers": 14, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 4, "norm_topk_prob": True,
    "tie_word_embeddings": False,
}  # fmt: skip


def _config(cfg: dict):
    from lightning_moe.lit_hf import hf_config_from

    return hf_config_from(cfg)


def _save_perturbed(cfg: dict, path: Path, seed: int) -> Path:
    """A random ``cfg`` model with every weight and the routers' correction biases moved off their
    init (so a tensor read from the wrong place, or not at all, shows), saved in 20 KB shards."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(str(path), max_shard_size="20KB")
    return path


def test_sharded_load_equals_one_process_hf_logits_exports_bitwise_and_loads_pipeline_stages(tmp_path: Path) -> None:
    """At EP4, then (same processes) at EP2 x EDP2, TP2 x ETP2 x EP2 (blocked w13 columns) and
    TP2 x ETP2 x EDP2 (w2's F dim split by ETP, then by FSDP: a strided shard); then the Qwen3-MoE
    and the DeepSeek-V3 checkpoints at PP2 x EP2 against their pp=1 loads."""
    qwen = _save_perturbed(SMALL, tmp_path / "hf", seed=0)
    deepseek = _save_perturbed(DEEPSEEK_V3, tmp_path / "deepseek_v3", seed=1)
    out = run_torchrun("worker_hf_sharded_load.py", 4, [
        "logits", str(qwen), str(tmp_path), "ep=4,ep=2,tp=2:etp=2:ep=2,tp=2:etp=2",
        "pipeline", str(qwen), str(tmp_path), "pp=2:ep=2",
        "pipeline", str(deepseek), str(tmp_path), "pp=2:ep=2",
    ], timeout=420)  # fmt: skip
    assert out.count("WORKER OK") == 4, out[-3000:]
    assert "PIPELINE OK hf pp=2:ep=2" in out and "PIPELINE OK deepseek_v3 pp=2:ep=2" in out, out[-3000:]


def _write_safetensors(file: Path, tensors: list[tuple[str, tuple[int, ...]]], gen: torch.Generator) -> None:
    """One safetensors file of random bf16 tensors, each made and written in turn (header first).

    Weights are uniform in +-0.03; norm weights are 1 plus that, so activations keep unit scale
    through the layers and every expert moves the logits."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in tensors:
            t = torch.empty(shape, dtype=torch.bfloat16).uniform_(-0.03, 0.03, generator=gen)
            if name.endswith("norm.weight"):
                t += 1
            f.write(t.view(torch.int16).numpy().tobytes())


def _write_synthetic(path: Path, cfg: dict, shard_bytes: int = 256 * 1024**2) -> int:
    """Random bf16 weights for every tensor name ``save_pretrained`` would write, shard by shard."""
    config = _config(cfg)
    path.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(str(path))
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for name, t in skeleton.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            E, two_F, H = t.shape
            prefix = name[: -len("gate_up_proj")]
            for i in range(E):
                shapes += [(f"{prefix}{i}.{w}_proj.weight", (two_F // 2, H)) for w in ("gate", "up")]
        elif name.endswith("mlp.experts.down_proj"):
            E, H, F = t.shape
            shapes += [(f"{name[: -len('down_proj')]}{i}.down_proj.weight", (H, F)) for i in range(E)]
        else:
            shapes.append((name, tuple(t.shape)))
    del skeleton
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = total = 0
    for name, shape in shapes:
        n = int(torch.Size(shape).numel())
        if groups[-1] and size + 2 * n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += 2 * n
        total += n
    for k, group in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(path / file, group, gen)
        weight_map.update(dict.fromkeys((n for n, _ in group), file))
    index = {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.mark.timeout(480)
def test_large_checkpoint_loads_within_each_ranks_memory_share_and_gives_transformers_logits(tmp_path: Path) -> None:
    hf = tmp_path / "large"
    try:
        start = time.perf_counter()
        params = _write_synthetic(hf, LARGE)
        print(f"wrote {params / 1e9:.3f} B parameters in {time.perf_counter() - start:.1f} s", flush=True)
        assert params >= 1.5e9, params
        out = run_torchrun("worker_hf_sharded_load.py", 4, ["memory", str(hf), str(tmp_path), "ep=4"], timeout=360)
        assert "WORKER OK" in out, out[-3000:]
        reports = json.loads((tmp_path / "memory.json").read_text())
        for r in reports:
            print({k: round(v / 2**20) if k not in ("rank", "load_s") else round(v, 1) for k, v in r.items()}, "MiB")
        assert len(reports) == 4 and all(r["peak"] <= r["budget"] for r in reports)
        print("logits against transformers:", json.loads((tmp_path / "logits.json").read_text()))
    finally:
        shutil.rmtree(hf, ignore_errors=True)
