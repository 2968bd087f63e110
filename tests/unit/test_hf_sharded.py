"""Reading HF safetensors slice by slice into a swapped model, and writing it back out.

One process here (plain tensors, and DTensors on threaded gloo ranks); tests/dist/test_dist_hf_sharded_load.py
runs the folded strategy on 4 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file

from lightning_moe.checkpoint.hf_sharded import HFCheckpoint, load_hf_checkpoint_sharded, reset_nonpersistent_buffers
from lightning_moe.checkpoint.hf_stream_export import stream_export_hf
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.hf import swap_moe_blocks

TINY = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
}  # fmt: skip
QWEN2 = {
    "model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip


def _hf_model(cfg: dict, seed: int = 0) -> nn.Module:
    from lightning_moe.lit_hf import hf_config_from

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config_from(cfg), attn_implementation="sdpa")
    with torch.no_grad():  # norms and biases away from their init, so a skipped tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _save(model: nn.Module, path: Path, shard: str = "20KB") -> Path:
    model.save_pretrained(str(path), max_shard_size=shard)
    return path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return HFCheckpoint(path).read_all()


def _sharded_lit(path: Path, **kw) -> HFMoELanguageModel:
    lit = HFMoELanguageModel(pretrained=str(path), load_sharded=True, moe={"experts_backend": "torch"}, **kw)
    assert all(p.is_meta for p in lit.model.parameters())
    lit.configure_model()  # no Trainer: materialised on the CPU and read whole
    return lit.eval()


@pytest.mark.parametrize("cfg", [TINY, QWEN2], ids=["qwen3_moe", "qwen2_moe_shared"])
def test_sharded_load_gives_the_hf_models_logits_and_exports_bitwise(tmp_path: Path, cfg: dict) -> None:
    hf = _save(_hf_model(cfg), tmp_path / "hf")
    lit = _sharded_lit(hf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lit(ids), ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    out = stream_export_hf(lit.model, tmp_path / "out", max_shard_bytes=4000)
    a, b = _tensors(hf), _tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)


def test_fused_expert_tensors_and_one_file_load_too(tmp_path: Path) -> None:
    model = _hf_model(TINY, seed=3)
    hf = tmp_path / "fused"
    hf.mkdir()
    model.config.save_pretrained(str(hf))  # the in-memory names: experts.gate_up_proj [E, 2F, H]
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(hf / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in HFCheckpoint(hf)
    lit = _sharded_lit(hf)
    ref = swap_moe_blocks(_hf_model(TINY, seed=3), experts_backend="torch")
    for (n, p), (m, q) in zip(lit.model.named_parameters(), ref.named_parameters()):
        assert n == m and torch.equal(p, q), n
    rotary = lit.model.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_bf16_checkpoint_into_fp32_model_is_cast(tmp_path: Path) -> None:
    hf = _save(_hf_model(TINY).to(torch.bfloat16), tmp_path / "bf16")
    lit = _sharded_lit(hf, dtype="float32")
    w = lit.model.model.layers[1].mlp.experts.w2
    assert w.dtype == torch.float32
    down = _tensors(hf)["model.layers.1.mlp.experts.5.down_proj.weight"]
    torch.testing.assert_close(w[5], down.float().t(), rtol=0, atol=0)


@pytest.mark.parametrize(("ep", "etp", "edp"), [(2, 1, 2), (2, 2, 1), (1, 2, 2), (4, 1, 1)])
def test_each_ranks_box_reads_its_shard_of_experts_and_dense_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ep: int, etp: int, edp: int
) -> None:
    """The slices a rank reads for its local box (EP experts, blocked ETP columns, EDP's H shard, a
    dense Shard(0)) equal ``shard_expert_weights`` of the full model, then FSDP's chunk."""
    import lightning_moe.checkpoint.hf_sharded as hs
    from lightning_moe.parallel.parallelize import shard_expert_weights

    hf = _save(_hf_model(TINY, seed=5), tmp_path / "hf")
    full = swap_moe_blocks(_hf_model(TINY, seed=5))
    real_box = hs.local_box
    for rank in range(ep * etp * edp):
        ep_rank, etp_rank, edp_rank = rank // (etp * edp), (rank // edp) % etp, rank % edp
        with torch.device("meta"):
            model = swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(full.config))
        model.to_empty(device="cpu")
        boxes: dict[int, tuple[torch.Tensor, tuple[slice, ...]]] = {}
        wants: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(model.model.layers):
            ex, ref = layer.mlp.experts, full.model.layers[i].mlp.experts
            ex.etp = etp
            w13, w2 = shard_expert_weights(ref.w13.detach(), ref.w2.detach(), ep_rank=ep_rank, ep=ep,
                                           etp_rank=etp_rank, etp=etp)  # fmt: skip
            e, (E, H, two_F) = w13.shape[0], ex.w13.shape
            h = H // edp
            for param, want, col_dim in ((ex.w13, w13, 2), (ex.w2, w2, 1)):
                want = want.chunk(edp, dim=1)[edp_rank]
                local = torch.full_like(want, float("nan"))
                box = [slice(ep_rank * e, (ep_rank + 1) * e), slice(0, param.shape[1]), slice(0, param.shape[2])]
                n = want.shape[col_dim] if col_dim == 2 else want.shape[1]
                box[col_dim] = slice(etp_rank * n, (etp_rank + 1) * n)
                h_dim = 1 if col_dim == 2 else 2
                box[h_dim] = slice(edp_rank * h, (edp_rank + 1) * h) if h_dim == 1 else box[h_dim]
                if col_dim == 1:  # w2 [e, f, H]: FSDP shards dim 1 (f) again
                    f = param.shape[1] // etp // edp
                    box[1] = slice(etp_rank * f * edp + edp_rank * f, etp_rank * f * edp + (edp_rank + 1) * f)
                boxes[id(param)] = (local, tuple(box))
                wants.append((local, want))
            q = layer.self_attn.q_proj.weight
            rows = q.shape[0] // (ep * etp * edp)
            local_q = torch.full((rows, q.shape[1]), float("nan"))
            boxes[id(q)] = (local_q, (slice(rank * rows, (rank + 1) * rows), slice(0, q.shape[1])))
            want_q = full.model.layers[i].self_attn.q_proj.weight.detach()[rank * rows : (rank + 1) * rows]
            wants.append((local_q, want_q))
        monkeypatch.setattr(hs, "local_box", lambda t: boxes.get(id(t)) or real_box(t))
        load_hf_checkpoint_sharded(model, hf)
        for got, want in wants:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_input_is_refused_with_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hub id: nothing is downloaded"):
        HFMoELanguageModel(pretrained="Qwen/Qwen3-30B-A3B", load_sharded=True)
    with pytest.raises(ValueError, match="needs pretrained"):
        HFMoELanguageModel(hf_config=TINY, load_sharded=True)
    hf = _save(_hf_model(TINY), tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (hf / file).rename(tmp_path / "aside")
    with pytest.raises(ValueError, match=f"shard files \\['{file}'\\].*missing"):
        HFMoELanguageModel(pretrained=str(hf), load_sharded=True)
    (tmp_path / "aside").rename(hf / file)
    del index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    lit = HFMoELanguageModel(pretrained=str(hf), load_sharded=True)
    with pytest.raises(ValueError, match=r"no tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        lit.configure_model()
    wrong = _save(_hf_model({**TINY, "moe_intermediate_size": 8}), tmp_path / "wrong")
    (wrong / "config.json").write_text((hf / "config.json").read_text())
    lit = HFMoELanguageModel(pretrained=str(wrong), load_sharded=True)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: expected \(16, 32\), found \(8, 32\)"):
        lit.configure_model()


def test_reset_nonpersistent_buffers_recomputes_rotary_and_zeroes_counters() -> None:
    model = swap_moe_blocks(_hf_model(TINY))
    want = model.model.rotary_emb.inv_freq.clone()
    for _, b in model.named_buffers():
        b.fill_(7.0)
    reset_nonpersistent_buffers(model)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, want, rtol=0, atol=0)
    assert float(model.model.layers[0].mlp.global_num_tokens.abs().sum()) == 0.0


def test_streaming_export_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    from lightning_moe.checkpoint.hf_stream_export import stream_export_dcp
    from lightning_moe.export import main as export_main

    unknown = swap_moe_blocks(_hf_model(TINY))
    unknown.model.layers[0].mlp.family = "made_up"
    with pytest.raises(ValueError, match=r"stream_export_hf: family 'made_up' has no HF checkpoint names here"):
        stream_export_hf(unknown, tmp_path / "m")
    with pytest.raises(ValueError, match="max_shard_bytes=0 must be a positive int"):
        stream_export_hf(swap_moe_blocks(_hf_model(TINY)), tmp_path / "q", max_shard_bytes=0)
    with pytest.raises(ValueError, match="needs an initialised process group"):
        stream_export_dcp(tmp_path, tmp_path / "x", group=None)
    (tmp_path / "one.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match="--streaming reads a DCP folder"):
        export_main([str(tmp_path / "one.ckpt"), str(tmp_path / "y"), "--streaming"])


def test_a_pipeline_ranks_stages_read_only_their_tensors(tmp_path: Path) -> None:
    """The last of two stages, cut from the meta model: it reads layer 1, the norm and the head (no
    embedding, nothing of layer 0), every tensor as the one-process swapped model holds it."""
    from lightning_moe.models.hf_pipeline_stage import cut_hf_rank_stages, hf_parameter_name
    from lightning_moe.parallel.pipeline import split_layers

    hf = _save(_hf_model(TINY), tmp_path / "hf")
    lit = HFMoELanguageModel(pretrained=str(hf), load_sharded=True, moe={"experts_backend": "torch"})
    stages = cut_hf_rank_stages(lit.model, split_layers(2, 2), (1,))
    stages.to_empty(device="cpu")
    unread = load_hf_checkpoint_sharded(stages, hf)
    reset_nonpersistent_buffers(stages)
    names = sorted(HFCheckpoint(hf).weight_map)
    assert unread == [n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    ref = HFMoELanguageModel(pretrained=str(hf), moe={"experts_backend": "torch"}).model
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    got = [*stages.named_parameters(), *stages.named_buffers()]
    assert {n.split(".")[0] for n, _ in got} == {"layers", "norm", "lm_head", "rotary_emb"}
    for name, t in got:
        hf_name = f"model.{name}" if name.startswith("rotary_emb.") else hf_parameter_name(name)
        assert torch.equal(t, want[hf_name]), name


def test_reads_that_would_leave_a_tensor_unset_are_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_moe.checkpoint.hf_sharded as hs

    hf = _save(_hf_model(TINY), tmp_path / "hf")
    lit = HFMoELanguageModel(pretrained=str(hf), load_sharded=True)
    direct = hs._Planner.direct

    def skipping_the_final_norm(self: hs._Planner, name: str, t: torch.Tensor) -> None:
        if name != "model.norm.weight":
            direct(self, name, t)

    monkeypatch.setattr(hs._Planner, "direct", skipping_the_final_norm)
    with pytest.raises(ValueError, match=r"would leave model\.norm\.weight unset"):
        lit.configure_model()


def test_stages_cut_for_another_layout_are_refused(tmp_path: Path) -> None:
    from lightning_moe.models.hf_pipeline_stage import cut_hf_rank_stages
    from lightning_moe.parallel.pipeline import split_layers
    from lightning_moe.strategies.pipeline_hf import hf_stages_cut_already

    lit = HFMoELanguageModel(hf_config=TINY, moe={"experts_backend": "torch"})
    assert hf_stages_cut_already("FoldedMoEStrategy", lit, (0,)) is None  # not cut: the strategy cuts it
    lit.model = cut_hf_rank_stages(lit.model, split_layers(2, 2), (1,))
    stages, hidden = hf_stages_cut_already("FoldedMoEStrategy", lit, (1,))  # type: ignore[misc]
    assert stages is lit.model and hidden == TINY["hidden_size"]
    with pytest.raises(ValueError, match=r"holds pipeline stages \(1,\) already, cut for another layout"):
        hf_stages_cut_already("FoldedMoEStrategy", lit, (0,))
