"""Every swappable HF family's ``save_pretrained`` checkpoint loads slice by slice and streams back out
bit for bit (``checkpoint/hf_names.py``: router path, correction bias, shared expert and gate,
per-expert ``gate_proj``/``w1`` names or fused experts, Mixtral's ``block_sparse_moe``).

One process: the checkpoint (fp32, random weights moved off their init, small shards) is read by
``HFMoELanguageModel(load_sharded=True)``; its logits equal the ``from_pretrained`` model's, and
``stream_export_hf`` writes the same tensor names, dtypes and bytes, which ``from_pretrained`` loads
to the same logits. The multi-rank loads are in ``tests/dist/test_dist_hf_family_checkpoints.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from lightning_moe.checkpoint.hf_names import saved_layer_names  # noqa: E402
from lightning_moe.checkpoint.hf_sharded import HFCheckpoint, load_hf_checkpoint_sharded  # noqa: E402
from lightning_moe.checkpoint.hf_stream_export import stream_export_hf  # noqa: E402
from lightning_moe.lit_hf import HFMoELanguageModel  # noqa: E402
from lightning_moe.models.hf import swap_moe_blocks  # noqa: E402

import test_hf_swap  # noqa: E402
from test_hf_families import VOCAB  # noqa: E402
from test_hf_family_sweep import sweep_model  # noqa: E402

NAMES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "olmoe", "dots1", "ernie4_5_moe",
         "hunyuan_v1_moe", "granitemoe", "deepseek_v2", "qwen3_next", "qwen3_5_moe", "minimax", "llama4",
         "gpt_oss", "minimax_m2", "glm4_moe_lite", "exaone_moe", "afmoe", "lfm2_moe", "cohere2_moe", "longcat_flash",
         "granitemoeshared", "granitemoehybrid", "jamba")  # fmt: skip
# Swappable families whose save_pretrained checkpoint the sharded loader does not read yet: load them
# with from_pretrained, then swap. ERNIE-4.5-VL saves text and vision experts as one list with a
# transposed router per modality and a stacked [2, E] bias; the others are not yet checked here.
NOT_SHARDED = ("kimi_linear", "granitemoe_swa", "qwen3_vl_moe", "glm4v_moe", "ernie4_5_vl_moe")


def build(name: str) -> nn.Module:
    model = test_hf_swap._model(name) if name in test_hf_swap.CONFIGS else sweep_model(name, tie_word_embeddings=False)
    with torch.no_grad():  # norms and biases off their init, so a tensor left unread shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model.eval()


def attention(name: str) -> str:
    """gpt-oss's sinks need the eager attention (transformers refuses sdpa for it)."""
    return "eager" if name == "gpt_oss" else "sdpa"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return HFCheckpoint(path).read_all()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", NAMES)
def test_saved_checkpoint_loads_sharded_and_exports_bitwise(tmp_path: Path, name: str) -> None:
    hf = tmp_path / "hf"
    build(name).save_pretrained(str(hf), max_shard_size="20KB")
    lit = HFMoELanguageModel(pretrained=str(hf), load_sharded=True, moe={"experts_backend": "torch"},
                             attn_implementation=attention(name))  # fmt: skip
    lit.configure_model()  # no Trainer: materialised on the CPU and read whole
    lit.eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
    with torch.no_grad():
        want = ref(input_ids=_ids()).logits
        torch.testing.assert_close(lit(_ids()), want, rtol=1e-5, atol=1e-5)
    out = stream_export_hf(lit.model, tmp_path / "out", max_shard_bytes=8000)
    a, b = tensors(hf), tensors(out)
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=_ids()).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixtral", "granitemoe", "llama4", "ernie4_5_moe", "gpt_oss"])
def test_in_memory_state_dict_loads_under_module_names(tmp_path: Path, name: str) -> None:
    """A ``state_dict`` written as it is (fused ``experts.gate_up_proj``, ``mlp.gate.weight``) reads too."""
    from safetensors.torch import save_file

    model = build(name)
    hf = tmp_path / "fused"
    hf.mkdir()
    model.config.save_pretrained(str(hf))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(hf / "model.safetensors"))
    ours = swap_moe_blocks(build(name), experts_backend="torch")
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    load_hf_checkpoint_sharded(ours, hf)
    want = swap_moe_blocks(build(name), experts_backend="torch")
    for (n, p), (m, q) in zip(ours.named_parameters(), want.named_parameters()):
        assert n == m and torch.equal(p, q), n


def test_saved_names_follow_each_familys_checkpoint() -> None:
    mixtral = saved_layer_names("model.layers.3.mlp", "mixtral")
    assert mixtral.router == "model.layers.3.block_sparse_moe.gate.weight"
    expert5 = "model.layers.3.block_sparse_moe.experts.5."
    assert mixtral.expert(5) == tuple(f"{expert5}{w}.weight" for w in ("w1", "w3", "w2"))
    granite = saved_layer_names("model.layers.0.block_sparse_moe", "granitemoe")
    assert granite.router == "model.layers.0.block_sparse_moe.router.layer.weight"
    assert granite.fused == ("model.layers.0.block_sparse_moe.input_linear.weight",
                             "model.layers.0.block_sparse_moe.output_linear.weight")  # fmt: skip
    assert saved_layer_names("model.layers.0.mlp", "ernie4_5_moe").bias == (
        "model.layers.0.mlp.moe_statics.e_score_correction_bias"
    )
    hunyuan = saved_layer_names("model.layers.0.mlp", "hunyuan_v1_moe")
    assert hunyuan.router == "model.layers.0.mlp.gate.wg.weight" and hunyuan.shared == "model.layers.0.mlp.shared_mlp."
    llama4 = saved_layer_names("model.layers.0.feed_forward", "llama4")
    assert llama4.transposed and llama4.fused == ("model.layers.0.feed_forward.experts.gate_up_proj",
                                                  "model.layers.0.feed_forward.experts.down_proj")  # fmt: skip
    with pytest.raises(ValueError, match=r"family 'made_up' has no HF checkpoint names here; known: \["):
        saved_layer_names("model.layers.0.mlp", "made_up")


def test_every_config_family_has_checkpoint_names() -> None:
    from lightning_moe.models.hf_families import FAMILIES

    swappable = {f.name for f in FAMILIES.values() if f.refused is None}
    assert swappable <= set(NAMES) | set(NOT_SHARDED), swappable - set(NAMES) - set(NOT_SHARDED)
    assert not set(NAMES) & set(NOT_SHARDED)


@pytest.mark.parametrize(("ep", "etp"), [(2, 2), (1, 2), (2, 1)])
def test_interleaved_experts_and_biases_read_into_each_ranks_blocked_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ep: int, etp: int
) -> None:
    """gpt-oss: the stepped reads of a rank's box (EP experts, ETP's ``[gate_j | up_j]`` blocks of
    ``w13`` and ``b13``, ``b2``'s H slice) equal ``shard_expert_weights`` / ``shard_expert_biases``."""
    import lightning_moe.checkpoint.hf_sharded as hs
    from lightning_moe.parallel.parallelize import shard_expert_biases, shard_expert_weights

    hf = tmp_path / "hf"
    build("gpt_oss").save_pretrained(str(hf), max_shard_size="20KB")
    full = swap_moe_blocks(build("gpt_oss"), experts_backend="torch")
    real_box = hs.local_box
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            model = swap_moe_blocks(build("gpt_oss"), experts_backend="torch")
            boxes: dict[int, tuple[torch.Tensor, tuple[slice, ...]]] = {}
            wants: list[tuple[torch.Tensor, torch.Tensor, str]] = []
            for i, layer in enumerate(model.model.layers):
                ex, ref = layer.mlp.experts, full.model.layers[i].mlp.experts
                ex.etp = etp
                kw = dict(ep_rank=ep_rank, ep=ep, etp_rank=etp_rank, etp=etp)
                w13, w2 = shard_expert_weights(ref.w13.detach(), ref.w2.detach(), **kw)
                b13, b2 = shard_expert_biases(ref.b13.detach(), ref.b2.detach(), **kw)
                e = w13.shape[0]
                experts = slice(ep_rank * e, (ep_rank + 1) * e)
                cols13 = slice(etp_rank * w13.shape[2], (etp_rank + 1) * w13.shape[2])
                f, h = w2.shape[1], b2.shape[1]
                for key, param, want, box in (
                    ("w13", ex.w13, w13, (experts, slice(0, w13.shape[1]), cols13)),
                    ("w2", ex.w2, w2, (experts, slice(etp_rank * f, (etp_rank + 1) * f), slice(0, w2.shape[2]))),
                    ("b13", ex.b13, b13, (experts, cols13)),
                    ("b2", ex.b2, b2, (experts, slice(etp_rank * h, (etp_rank + 1) * h))),
                ):
                    local = torch.full_like(want, float("nan"))
                    boxes[id(param)] = (local, box)
                    wants.append((local, want, f"layer {i} {key}"))
            monkeypatch.setattr(hs, "local_box", lambda t: boxes.get(id(t)) or real_box(t))
            load_hf_checkpoint_sharded(model, hf)
            for got, want, what in wants:
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
