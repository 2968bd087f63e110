"""Checkpoint → HF safetensors export, checked by reloading with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L
from torch.utils.data import DataLoader

from lightning_moe.export import export_checkpoint, export_state_dict, load_checkpoint, main, strip_prefix
from lightning_moe.lit_hf import HFMoELanguageModel

VOCAB = 64
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 4,
        "n_group": 2, "topk_group": 2, "routed_scaling_factor": 2.5, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    },
}  # fmt: skip


def _batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        w = torch.randint(0, VOCAB, (2, 17), generator=g)
        out.append({"input_ids": w[:, :-1], "labels": w[:, 1:]})
    return out


def _trained(family: str, tmp_path: Path) -> tuple[HFMoELanguageModel, Path]:
    torch.manual_seed(0)
    lit = HFMoELanguageModel(
        hf_config=HF_CONFIGS[family], moe={"aux_loss": "switch"}, warmup_steps=1, learning_rate=1e-2
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(lit, DataLoader(_batches(), batch_size=None))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    return lit.eval(), ckpt


def _reload_logits(out_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).float().eval()
    return hf(input_ids=ids).logits


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_lightning_ckpt_exports_to_safetensors_that_transformers_reloads(family: str, tmp_path: Path) -> None:
    lit, ckpt = _trained(family, tmp_path)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(_reload_logits(out, _ids()), lit(_ids()), atol=1e-5, rtol=1e-5)


def test_dcp_checkpoint_dir_exports_like_model_parallel_strategy_writes_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    lit, _ = _trained("qwen3_moe", tmp_path)
    dcp_dir = tmp_path / "dcp"
    # The ModelParallelStrategy layout: DCP shards of {"state_dict", "optimizer_0"} + meta.pt.
    dcp.save({"state_dict": lit.state_dict()}, checkpoint_id=str(dcp_dir), no_dist=True)
    torch.save({"hyper_parameters": dict(lit.hparams), "global_step": 2}, dcp_dir / "meta.pt")
    state, hparams = load_checkpoint(dcp_dir)
    assert set(state) == set(lit.state_dict()) and hparams["hf_config"]["model_type"] == "qwen3_moe"
    out = export_checkpoint(dcp_dir, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(_reload_logits(out, _ids()), lit(_ids()), atol=1e-5, rtol=1e-5)


def test_export_state_dict_takes_a_state_dict_and_a_config_dir(tmp_path: Path) -> None:
    lit = HFMoELanguageModel(hf_config=HF_CONFIGS["qwen3_moe"]).eval()
    cfg_dir = tmp_path / "cfg"
    lit.model.config.save_pretrained(cfg_dir)
    out = export_state_dict(lit.model.state_dict(), tmp_path / "hf", hf_config=str(cfg_dir), dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert hf.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 32, 32)


def test_console_script_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, ckpt = _trained("qwen3_moe", tmp_path)
    main([str(ckpt), str(tmp_path / "hf"), "--dtype", "bfloat16"])
    assert "exported" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").is_file()


def test_strip_prefix_without_match_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"prefix='model\.'.*set --prefix"):
        strip_prefix({"layer.weight": torch.zeros(1)}, "model.")


def test_load_checkpoint_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.ckpt")


def _block_w13_by_hand(w13_EH2F: torch.Tensor, etp: int) -> torch.Tensor:
    """``[gate | up]`` columns to the folded_moe ETP layout ``[gate_0 | up_0 | gate_1 | up_1 | ...]``."""
    F = w13_EH2F.shape[-1] // 2
    f = F // etp
    gate, up = w13_EH2F[..., :F], w13_EH2F[..., F:]
    pieces = [(gate[..., j * f : (j + 1) * f], up[..., j * f : (j + 1) * f]) for j in range(etp)]
    return torch.cat([t for pair in pieces for t in pair], -1)


def test_export_with_etp_reorders_blocked_w13_back_to_gate_then_up(tmp_path: Path) -> None:
    lit = HFMoELanguageModel(hf_config=HF_CONFIGS["qwen3_moe"]).eval()
    state = lit.model.state_dict()
    blocked = {k: _block_w13_by_hand(v, 2) if k.endswith("experts.w13") else v for k, v in state.items()}
    assert not torch.equal(blocked["model.layers.0.mlp.experts.w13"], state["model.layers.0.mlp.experts.w13"])
    out = export_state_dict(blocked, tmp_path / "hf", hf_config=lit.model.config, etp=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for i in range(2):
        w13 = state[f"model.layers.{i}.mlp.experts.w13"]
        assert torch.equal(hf.model.layers[i].mlp.experts.gate_up_proj, w13.transpose(1, 2))


def test_export_rejects_etp_below_one_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="etp=0 must be >= 1"):
        export_state_dict({}, tmp_path / "hf", hf_config=HF_CONFIGS["qwen3_moe"], etp=0)

