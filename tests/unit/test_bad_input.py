"""Bad input gets one clear line, early: ``Owner: field=value breaks rule; fix.``

One table per area (configuration, the layer's input, the LightningModules, strategy, callbacks,
data, Hugging Face loading, the CLI). Each case builds the object with one bad argument and checks
the exception type, that the message names the bad value, and that it is one line. The cases
marked ``found:`` were accepted, or failed deep in torch or the parser, before these checks.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch

from lightning_moe.callbacks import CPUOffload, CUDAGraphCapture, ECHOExpertCloning, MoEMonitor, RouterReplay
from lightning_moe.cli import main, short_parser_message
from lightning_moe.config import KernelConfig, MoEConfig
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModel
from lightning_moe.lit_hf import HFMoELanguageModel
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.pipeline import check_batch_split, check_microbatches, check_schedule, split_layers
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy
from lightning_moe.strategies.pipeline_setup import check_pipeline_callbacks, check_pipeline_trainer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe.yaml"
NAN, INF = float("nan"), float("inf")

MOE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
# A small HF config: a case whose check is missing builds this model, not the full-size default.
HF_TINY = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip


def _tc(**overrides: Any) -> TransformerConfig:
    base: dict[str, Any] = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, moe=MoEConfig(**MOE))
    return TransformerConfig(**{**base, **overrides})


def _lm(**overrides: Any) -> MoELanguageModel:
    return MoELanguageModel(_tc(), **overrides)


Case = tuple[Callable[[], Any], type[BaseException], str]


def _check(case: Case) -> None:
    build, exc_type, names = case
    with pytest.raises(exc_type, match=re.escape(names)) as info:
        build()
    message = str(info.value)
    assert "\n" not in message, message
    assert re.match(r"^[\w.<>-]+: ", message), message  # starts with its owner


# --- configuration: MoEConfig, KernelConfig, TransformerConfig -------------------------------------

CONFIG_CASES: dict[str, Case] = {
    "found: MoEConfig hidden_size=True": (lambda: MoEConfig(**{**MOE, "hidden_size": True}), ValueError, "MoEConfig: hidden_size=True"),
    "found: MoEConfig aux_loss_coeff=nan": (lambda: MoEConfig(**MOE, aux_loss_coeff=NAN), ValueError, "aux_loss_coeff=nan"),
    "found: MoEConfig init_std=-0.02": (lambda: MoEConfig(**MOE, init_std=-0.02), ValueError, "MoEConfig: init_std=-0.02"),
    "MoEConfig top_k=True": (lambda: MoEConfig(**{**MOE, "top_k": True}), ValueError, "top_k=True"),
    "MoEConfig num_experts=0": (lambda: MoEConfig(**{**MOE, "num_experts": 0}), ValueError, "num_experts=0"),
    "MoEConfig ffn_hidden_size=8.0": (lambda: MoEConfig(**{**MOE, "ffn_hidden_size": 8.0}), ValueError, "ffn_hidden_size=8.0"),
    "MoEConfig top_k > num_experts": (lambda: MoEConfig(**{**MOE, "top_k": 5}), ValueError, "top_k=5 exceeds num_experts=4"),
    "MoEConfig aux_loss_coeff=inf": (lambda: MoEConfig(**MOE, aux_loss_coeff=INF), ValueError, "aux_loss_coeff=inf"),
    "MoEConfig aux_loss_coeff str": (lambda: MoEConfig(**MOE, aux_loss_coeff="0.1"), ValueError, "aux_loss_coeff='0.1'"),
    "MoEConfig z_loss_coeff=nan": (lambda: MoEConfig(**MOE, z_loss_coeff=NAN), ValueError, "z_loss_coeff=nan"),
    "MoEConfig bias_update_rate=nan": (lambda: MoEConfig(**MOE, bias_update_rate=NAN), ValueError, "bias_update_rate=nan"),
    "MoEConfig init_std=nan": (lambda: MoEConfig(**MOE, init_std=NAN), ValueError, "init_std=nan"),
    "MoEConfig scaling_factor=0": (lambda: MoEConfig(**MOE, scaling_factor=0.0), ValueError, "scaling_factor=0.0"),
    "MoEConfig capacity_factor=inf": (lambda: MoEConfig(**MOE, capacity_factor=INF), ValueError, "capacity_factor=inf"),
    "MoEConfig shared_expert_ffn_size=True": (lambda: MoEConfig(**MOE, shared_expert_ffn_size=True), ValueError, "shared_expert_ffn_size=True"),
    "MoEConfig num_groups=True": (lambda: MoEConfig(**MOE, num_groups=True, group_topk=1), ValueError, "num_groups=True"),
    "MoEConfig pre_softmax='yes'": (lambda: MoEConfig(**MOE, pre_softmax="yes"), TypeError, "pre_softmax='yes'"),
    "MoEConfig score_func": (lambda: MoEConfig(**MOE, score_func="relu"), ValueError, "score_func='relu'"),
    "MoEConfig kernels type": (lambda: MoEConfig(**MOE, kernels="cutlass"), TypeError, "kernels='cutlass'"),
    "KernelConfig gemm": (lambda: KernelConfig(gemm="cublas"), ValueError, "gemm='cublas'"),
    "KernelConfig wgrad_streams_w13='2'": (lambda: KernelConfig(wgrad_streams_w13="2"), ValueError, "wgrad_streams_w13='2'"),
    "found: TransformerConfig init_std=-0.02": (lambda: _tc(init_std=-0.02), ValueError, "TransformerConfig: init_std=-0.02"),
    "TransformerConfig vocab_size=0": (lambda: _tc(vocab_size=0), ValueError, "vocab_size=0"),
    "TransformerConfig vocab_size=True": (lambda: _tc(vocab_size=True), ValueError, "vocab_size=True"),
    "TransformerConfig num_layers=0": (lambda: _tc(num_layers=0), ValueError, "num_layers=0"),
    "TransformerConfig num_heads=0": (lambda: _tc(num_heads=0), ValueError, "num_heads=0"),
    "TransformerConfig num_kv_heads=0": (lambda: _tc(num_kv_heads=0), ValueError, "num_kv_heads=0"),
    "TransformerConfig max_seq_len=0": (lambda: _tc(max_seq_len=0), ValueError, "max_seq_len=0"),
    "TransformerConfig rope_theta=0": (lambda: _tc(rope_theta=0.0), ValueError, "rope_theta=0.0"),
    "TransformerConfig norm_eps=-1": (lambda: _tc(norm_eps=-1.0), ValueError, "norm_eps=-1.0"),
    "TransformerConfig dense_ffn_hidden_size=0": (lambda: _tc(dense_ffn_hidden_size=0), ValueError, "dense_ffn_hidden_size=0"),
    "TransformerConfig moe str": (lambda: _tc(moe="x"), TypeError, "moe='x'"),
    "TransformerConfig num_heads=3": (lambda: _tc(num_heads=3), ValueError, "num_heads=3"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(case: str) -> None:
    _check(CONFIG_CASES[case])


def test_transformer_config_takes_its_moe_config_as_a_dict() -> None:
    assert _tc(moe=dict(MOE)).moe == MoEConfig(**MOE)


# --- the layer's input -------------------------------------------------------------------------------

LAYER_CASES: dict[str, Case] = {
    "found: int64 input": (lambda: MoELayer(MoEConfig(**MOE))(torch.zeros(2, 16, dtype=torch.int64)), TypeError, "dtype=torch.int64"),
    "bool input": (lambda: MoELayer(MoEConfig(**MOE))(torch.zeros(2, 16, dtype=torch.bool)), TypeError, "dtype=torch.bool"),
    "list input": (lambda: MoELayer(MoEConfig(**MOE))([[0.0] * 16]), TypeError, "input is a list"),
    "wrong width": (lambda: MoELayer(MoEConfig(**MOE))(torch.zeros(2, 8)), ValueError, "hidden_size=16"),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_bad_layer_input(case: str) -> None:
    _check(LAYER_CASES[case])


# --- the LightningModules ----------------------------------------------------------------------------

MODULE_CASES: dict[str, Case] = {
    "found: warmup_steps=-5": (lambda: _lm(warmup_steps=-5), ValueError, "MoELanguageModel: warmup_steps=-5"),
    "found: learning_rate=-1": (lambda: _lm(learning_rate=-1), ValueError, "MoELanguageModel: learning_rate=-1"),
    "found: betas=(1.5, 0.9)": (lambda: _lm(betas=(1.5, 0.9)), ValueError, "betas=(1.5, 0.9)"),
    "learning_rate=nan": (lambda: _lm(learning_rate=NAN), ValueError, "learning_rate=nan"),
    "weight_decay=-1": (lambda: _lm(weight_decay=-1), ValueError, "weight_decay=-1"),
    "warmup_steps=1.5": (lambda: _lm(warmup_steps=1.5), ValueError, "warmup_steps=1.5"),
    "three betas": (lambda: _lm(betas=(0.9, 0.9, 0.9)), ValueError, "betas=(0.9, 0.9, 0.9)"),
    "optimizer_impl": (lambda: _lm(optimizer_impl="apex"), ValueError, "optimizer_impl='apex'"),
    "HF learning_rate=-1": (
        lambda: HFMoELanguageModel(hf_config=HF_TINY, learning_rate=-1),
        ValueError,
        "HFMoELanguageModel: learning_rate=-1",
    ),
}


@pytest.mark.parametrize("case", sorted(MODULE_CASES))
def test_bad_module_argument(case: str) -> None:
    _check(MODULE_CASES[case])


def test_found_model_vocabulary_smaller_than_the_data_is_refused_at_setup(tmp_path: Path) -> None:
    """A 64-token model on byte data (ids up to 255) fails at setup, not with an IndexError in the embedding."""
    model = _lm()
    data = MoEDataModule(seq_len=8, batch_size=2, max_bytes=2_000)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    message = "MoELanguageModel: model vocab_size=64 is smaller than MoEDataModule's vocab_size=256"
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.fit(model, datamodule=data)
    assert model.global_step == 0


def test_pipeline_batch_not_divisible_is_refused_before_any_process_group(tmp_path: Path) -> None:
    """A data module whose batch does not split into pp_microbatches fails in setup_environment, first."""
    strategy = FoldedMoEStrategy(pp=2, pp_microbatches=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    data = MoEDataModule(seq_len=8, batch_size=6, max_bytes=2_000)
    message = "FoldedMoEStrategy: batch_size=6 does not divide into n_microbatches=4"
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.fit(MoELanguageModel(_tc(num_layers=2, vocab_size=256)), datamodule=data)
    assert not torch.distributed.is_initialized()


# --- strategy ----------------------------------------------------------------------------------------

STRATEGY_CASES: dict[str, Case] = {
    "tp=0": (lambda: FoldedMoEStrategy(tp=0), ValueError, "tp=0"),
    "tp=True": (lambda: FoldedMoEStrategy(tp=True), ValueError, "tp=True"),
    "ep=-1": (lambda: FoldedMoEStrategy(ep=-1), ValueError, "ep=-1"),
    "etp=1.5": (lambda: FoldedMoEStrategy(etp=1.5), ValueError, "etp=1.5"),
    "pp=0": (lambda: FoldedMoEStrategy(pp=0), ValueError, "pp=0"),
    "pp_schedule unknown": (lambda: FoldedMoEStrategy(pp=2, pp_schedule="zero_bubble"), ValueError, "pp_schedule='zero_bubble' is unknown"),
    "pp_schedule torch lacks": (lambda: _without_schedule("ScheduleDualPipeV", lambda: FoldedMoEStrategy(pp=2, pp_schedule="dualpipev")), ValueError, "schedule='dualpipev' needs torch.distributed.pipelining.ScheduleDualPipeV"),
    "pp_microbatches too few": (lambda: FoldedMoEStrategy(pp=4, pp_microbatches=2), ValueError, "n_microbatches=2 is fewer than the 4"),
    "pp_microbatches=0": (lambda: FoldedMoEStrategy(pp=2, pp_microbatches=0), ValueError, "pp_microbatches=0"),
    "pp_virtual_stages 1f1b": (lambda: FoldedMoEStrategy(pp=2, pp_virtual_stages=2), ValueError, "virtual_stages=2; set virtual_stages=1"),
    "pp batch not divisible": (lambda: FoldedMoEStrategy(pp=2, pp_microbatches=4).check_pipeline_batch(6), ValueError, "batch_size=6 does not divide into n_microbatches=4"),
    "pp layers not divisible": (lambda: FoldedMoEStrategy(pp=2).check_pipeline_model(MoELanguageModel(_tc(num_layers=3))), ValueError, "num_layers=3 does not split evenly into 2 stages"),
    "pp tied embeddings": (lambda: FoldedMoEStrategy(pp=2).check_pipeline_model(MoELanguageModel(_tc(num_layers=2, tie_embeddings=True))), ValueError, "tie_embeddings=True shares the embedding with the head"),
    "pp cp HF gpt-oss sinks": (lambda: FoldedMoEStrategy(pp=2, cp=2).check_pipeline_model(_hf("gpt_oss", num_hidden_layers=2, layer_types=["full_attention"] * 2, tie_word_embeddings=False)), TypeError, "(GptOssAttention) is attention that context parallelism cannot wrap: its attention adds per-head sinks"),
    "pp with vocab_parallel": (lambda: FoldedMoEStrategy(pp=2, tp=2, vocab_parallel=True), ValueError, "vocab_parallel=True with pp=2 is not supported"),
    "pp sequence_parallel HF deepseek mla": (lambda: FoldedMoEStrategy(pp=2, tp=2, sequence_parallel=True).check_pipeline_model(_hf("deepseek_v3", num_hidden_layers=2, tie_word_embeddings=False, **_MLA)), ValueError, "FoldedMoEStrategy: sequence_parallel=True is not supported with model.layers.0.self_attn (DeepseekV3Attention)"),
    "pp callback refused": (lambda: check_pipeline_callbacks("FoldedMoEStrategy", FoldedMoEStrategy(pp=2).pipeline_options, [CPUOffload()]), ValueError, "the CPUOffload callback works on the whole model"),
    "pp fp16 loss scaling": (lambda: check_pipeline_trainer("FoldedMoEStrategy", FoldedMoEStrategy(pp=2).pipeline_options, SimpleNamespace(callbacks=[], precision="16-mixed", precision_plugin=SimpleNamespace(scaler=object()))), ValueError, "precision='16-mixed' scales the loss for fp16"),
    "Fabric pp_microbatches too few": (lambda: FabricFoldedMoEStrategy(pp=2, pp_schedule="zbv", pp_microbatches=3), ValueError, "n_microbatches=3 is fewer than the 4"),
    "pp overlap 1f1b": (lambda: FoldedMoEStrategy(pp=2, ep=2, pp_overlap_expert_comm=True), ValueError, "pp_overlap_expert_comm=True with pp_schedule='1f1b'"),
    "pp overlap ep=1": (lambda: FoldedMoEStrategy(pp=2, pp_schedule="dualpipev", pp_overlap_expert_comm=True), ValueError, "pp_overlap_expert_comm=True with ep=1"),
    "pp overlap pp=1": (lambda: FoldedMoEStrategy(ep=2, pp_overlap_expert_comm=True), ValueError, "pp_overlap_expert_comm=True with pp=1"),
    "pp overlap allgather": (lambda: FoldedMoEStrategy(pp=2, ep=2, pp_schedule="dualpipev", dispatcher="allgather", pp_overlap_expert_comm=True), ValueError, "dispatcher='allgather'"),
    "pp overlap not bool": (lambda: FoldedMoEStrategy(pp=2, ep=2, pp_schedule="dualpipev", pp_overlap_expert_comm="yes"), ValueError, "pp_overlap_expert_comm='yes'"),
    "Fabric pp overlap zbv": (lambda: FabricFoldedMoEStrategy(pp=2, ep=2, pp_schedule="zbv", pp_overlap_expert_comm=True), ValueError, "pp_overlap_expert_comm=True with pp_schedule='zbv'"),
    "cp=0": (lambda: FoldedMoEStrategy(cp=0), ValueError, "cp=0"),
    "sequence_parallel tp=1": (lambda: FoldedMoEStrategy(sequence_parallel=True), ValueError, "needs tensor parallel"),
    "vocab_parallel str": (lambda: FoldedMoEStrategy(tp=2, vocab_parallel="yes"), TypeError, "vocab_parallel='yes'"),
    "dp=0": (lambda: FoldedMoEStrategy(dp=0), ValueError, "dp=0"),
    "dp='all'": (lambda: FoldedMoEStrategy(dp="all"), ValueError, "dp='all'"),
    "edp=True": (lambda: FoldedMoEStrategy(edp=True), ValueError, "edp=True"),
    "order lacks axes": (lambda: FoldedMoEStrategy(order="tp-ep-dp"), ValueError, "order='tp-ep-dp'"),
    "order repeats": (lambda: FoldedMoEStrategy(order="tp-tp-cp-ep-dp-pp"), ValueError, "repeats 'tp'"),
    "order unknown axis": (lambda: FoldedMoEStrategy(order="tp-cp-xx-dp-pp"), ValueError, "unknown token 'xx'"),
    "dispatcher": (lambda: FoldedMoEStrategy(dispatcher="nccl"), ValueError, "dispatcher='nccl'"),
    "timeout=-1": (lambda: FoldedMoEStrategy(timeout=-1), ValueError, "timeout=-1"),
    "timeout str": (lambda: FoldedMoEStrategy(timeout="x"), TypeError, "timeout='x'"),
    "Fabric tp=0": (lambda: FabricFoldedMoEStrategy(tp=0), ValueError, "tp=0"),
    "Fabric dispatcher": (lambda: FabricFoldedMoEStrategy(dispatcher="x"), ValueError, "dispatcher='x'"),
}


def _without_schedule(name: str, make: Callable[[], Any]) -> Any:
    """``make()`` while ``torch.distributed.pipelining`` lacks the class ``name`` (an older torch)."""
    import torch.distributed.pipelining as pipelining

    saved = getattr(pipelining, name)
    delattr(pipelining, name)
    try:
        return make()
    finally:
        setattr(pipelining, name, saved)


@pytest.mark.parametrize("case", sorted(STRATEGY_CASES))
def test_bad_strategy_argument(case: str) -> None:
    _check(STRATEGY_CASES[case])


# --- callbacks ---------------------------------------------------------------------------------------

CALLBACK_CASES: dict[str, Case] = {
    "MoEMonitor log_every_n_steps=0": (lambda: MoEMonitor(log_every_n_steps=0), ValueError, "log_every_n_steps=0"),
    "MoEMonitor log_every_n_steps=True": (lambda: MoEMonitor(log_every_n_steps=True), ValueError, "log_every_n_steps=True"),
    "MoEMonitor heatmap_every_n_steps=0": (lambda: MoEMonitor(heatmap_every_n_steps=0), ValueError, "heatmap_every_n_steps=0"),
    "RouterReplay mode": (lambda: RouterReplay(mode="play", path="routes"), ValueError, "mode='play'"),
    "RouterReplay steps_per_file=0": (lambda: RouterReplay(mode="record", path="routes", steps_per_file=0), ValueError, "steps_per_file=0"),
    "ECHO spare_slots_per_rank=0": (lambda: ECHOExpertCloning(spare_slots_per_rank=0), ValueError, "spare_slots_per_rank=0"),
    "ECHO interval=0": (lambda: ECHOExpertCloning(interval=0), ValueError, "interval=0"),
    "ECHO tolerance=-1": (lambda: ECHOExpertCloning(tolerance=-1), ValueError, "tolerance=-1"),
    "ECHO tolerance=nan": (lambda: ECHOExpertCloning(tolerance=NAN), ValueError, "tolerance=nan"),
    "ECHO grad_scale=0": (lambda: ECHOExpertCloning(grad_scale=0.0), ValueError, "grad_scale=0.0"),
    "CPUOffload activations str": (lambda: CPUOffload(activations="moe"), ValueError, "activations='moe'"),
    "CPUOffload min_tensor_bytes=-1": (lambda: CPUOffload(min_tensor_bytes=-1), ValueError, "min_tensor_bytes=-1"),
    "CPUOffload max_offload_gib=0": (lambda: CPUOffload(max_offload_gib=0), ValueError, "max_offload_gib=0"),
    "CPUOffload prefetch=-1": (lambda: CPUOffload(prefetch=-1), ValueError, "prefetch=-1"),
    "CUDAGraphCapture warmup_steps=0": (lambda: CUDAGraphCapture(warmup_steps=0), ValueError, "warmup_steps=0"),
    "CUDAGraphCapture modules str": (lambda: CUDAGraphCapture(modules="router"), ValueError, "modules='router'"),
}


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_bad_callback_argument(case: str) -> None:
    _check(CALLBACK_CASES[case])


# --- data --------------------------------------------------------------------------------------------

DATA_CASES: dict[str, Case] = {
    "seq_len=0": (lambda: MoEDataModule(seq_len=0), ValueError, "seq_len=0"),
    "seq_len=True": (lambda: MoEDataModule(seq_len=True), ValueError, "seq_len=True"),
    "seq_len str": (lambda: MoEDataModule(seq_len="128"), ValueError, "seq_len='128'"),
    "batch_size=0": (lambda: MoEDataModule(batch_size=0), ValueError, "batch_size=0"),
    "batch_size=2.5": (lambda: MoEDataModule(batch_size=2.5), ValueError, "batch_size=2.5"),
    "path missing": (lambda: MoEDataModule(path="/nonexistent/corpus.txt"), ValueError, "path='/nonexistent/corpus.txt'"),
    "path not a str": (lambda: MoEDataModule(path=3), TypeError, "path=3"),
    "val_fraction=0": (lambda: MoEDataModule(val_fraction=0.0), ValueError, "val_fraction=0.0"),
    "val_fraction=1": (lambda: MoEDataModule(val_fraction=1.0), ValueError, "val_fraction=1.0"),
    "val_fraction=nan": (lambda: MoEDataModule(val_fraction=NAN), ValueError, "val_fraction=nan"),
    "max_bytes=0": (lambda: MoEDataModule(max_bytes=0), ValueError, "max_bytes=0"),
    "num_workers=-1": (lambda: MoEDataModule(num_workers=-1), ValueError, "num_workers=-1"),
    "vocab_size=0": (lambda: MoEDataModule(vocab_size=0), ValueError, "vocab_size=0"),
    "seed str": (lambda: MoEDataModule(seed="x"), TypeError, "seed='x'"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_argument(case: str) -> None:
    _check(DATA_CASES[case])


# --- Hugging Face loading ----------------------------------------------------------------------------

HF_CASES: dict[str, Case] = {
    "missing directory": (lambda: HFMoELanguageModel(pretrained="/nonexistent/model"), ValueError, "pretrained='/nonexistent/model'"),
    "unknown family": (lambda: HFMoELanguageModel(hf_config={"model_type": "qwen9_moe"}), ValueError, "model_type='qwen9_moe'"),
    "no model_type": (lambda: HFMoELanguageModel(hf_config={"hidden_size": 8}), ValueError, "hf_config has no model_type"),
    "both sources": (lambda: HFMoELanguageModel(hf_config=HF_TINY, pretrained="/tmp"), ValueError, "pretrained='/tmp'"),
    "no source": (lambda: HFMoELanguageModel(), ValueError, "pretrained=None"),
    "dtype": (lambda: HFMoELanguageModel(hf_config=HF_TINY, dtype="fp8"), ValueError, "dtype='fp8'"),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_bad_hf_argument(case: str) -> None:
    _check(HF_CASES[case])


# --- CLI ---------------------------------------------------------------------------------------------

CLI_CASES: dict[str, tuple[list[str], str]] = {
    "found: unknown model key": (["--model.init_args.learnin_rate=0.1"], "learnin_rate"),
    "found: seq_len=0": (["--data.init_args.seq_len=0"], "MoEDataModule: seq_len=0"),
    "unknown trainer key": (["--trainer.max_stepz=3"], "max_stepz"),
    "bad type": (["--data.init_args.batch_size=abc"], "batch_size"),
    "moe rule": (["--model.init_args.model.moe.top_k=9"], "top_k=9"),
    "learning_rate=-1": (["--model.init_args.optimizer.learning_rate=-1"], "learning_rate=-1"),
    "missing config": (["--config", "missing_recipe.yaml"], "missing_recipe.yaml"),
    "strategy degree": (
        ["--trainer.strategy=lightning_moe.strategies.FoldedMoEStrategy", "--trainer.strategy.init_args.ep=0"],
        "ep=0",
    ),
    "callback argument": (
        ["--trainer.callbacks+=lightning_moe.callbacks.MoEMonitor", "--trainer.callbacks.log_every_n_steps=0"],
        "log_every_n_steps=0",
    ),
}


def _cli_error(extra: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Everything the CLI tells the user: stderr plus the message of its SystemExit."""
    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(CONFIG), *extra, "--trainer.max_steps=1"])
    assert info.value.code not in (0, None)
    code = info.value.code if isinstance(info.value.code, str) else ""
    return err.getvalue() + code


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_error_is_short_and_names_the_value(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    extra, names = CLI_CASES[case]
    if extra[0] == "--config":  # replaces the recipe
        monkeypatch.setattr(sys, "argv", ["lightning-moe"])
        with pytest.raises(SystemExit) as info:
            main(["fit", *extra])
        text = str(info.value.code)
    else:
        text = _cli_error(extra, monkeypatch)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 3, text
    assert names in lines[0], text
    assert "Traceback" not in text and "Given value" not in text, text


def test_cli_help_still_prints_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code in (0, None)
    assert "--config" in out.getvalue() and "--print_config" in out.getvalue()


def test_cli_console_script_prints_one_line_without_a_traceback() -> None:
    """The real process: a constructor's refusal reaches stderr as its own line, exit status 1."""
    result = subprocess.run(
        [sys.executable, "-c", "from lightning_moe.cli import main; main()", "fit", "--config", str(CONFIG),
         "--data.init_args.seq_len=0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert result.returncode == 1, result.stderr
    assert lines[-1] == "MoEDataModule: seq_len=0 must be an int >= 1; use a positive int.", result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) <= 3, result.stderr


def test_short_parser_message_keeps_the_key_path_and_the_reason() -> None:
    dump = """Parser key "data":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning_moe.data.datamodule.MoEDataModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_moe.data.MoEDataModule':
        Parser key "batch_size":
          Expected a <class 'int'>. Got value: abc
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>"""
    assert short_parser_message(dump) == "data.batch_size: Expected a <class 'int'>. Got value: abc"
    ours = "Parser key \"model\":\n  Errors:\n    - MoEConfig: top_k=9 exceeds num_experts=8; choose top_k <= 8.\n"
    assert short_parser_message(ours) == "MoEConfig: top_k=9 exceeds num_experts=8; choose top_k <= 8."


# --- pipeline parallel plan (checked before any process group) --------------------------------------

PIPELINE_CASES: dict[str, Case] = {
    "layers not divisible": (lambda: split_layers(6, 4), ValueError, "num_layers=6 does not split evenly into 4 stages"),
    "layers not divisible virtual": (lambda: split_layers(6, 2, 2), ValueError, "virtual_stages=2"),
    "fewer layers than stages": (lambda: split_layers(3, 2, 2), ValueError, "num_layers=3 is fewer than the 4 stages"),
    "weights length": (lambda: split_layers(4, 2, weights=[1.0] * 3), ValueError, "weights has 3 entries"),
    "weight nan": (lambda: split_layers(4, 2, weights=[1.0, NAN, 1.0, 1.0]), ValueError, "cost nan"),
    "pp=0": (lambda: split_layers(4, 0), ValueError, "pp=0"),
    "unknown schedule": (lambda: check_schedule("zero_bubble"), ValueError, "schedule='zero_bubble' is unknown"),
    "interleaved v=1": (lambda: check_schedule("interleaved_1f1b", 1), ValueError, "virtual_stages=1"),
    "zbv v=3": (lambda: check_schedule("zbv", 3), ValueError, "virtual_stages=3; set virtual_stages=2"),
    "1f1b v=2": (lambda: check_schedule("1f1b", 2), ValueError, "virtual_stages=2; set virtual_stages=1"),
    "1f1b micro < pp": (lambda: check_microbatches("1f1b", 2, 4), ValueError, "n_microbatches=2 is fewer than the 4"),
    "dualpipev micro < stages": (lambda: check_microbatches("dualpipev", 3, 2, 2), ValueError, "n_microbatches=3"),
    "interleaved rounds": (lambda: check_microbatches("interleaved_1f1b", 9, 4, 2), ValueError, "n_microbatches=9 is not a multiple of its 2 rounds"),
    "micro=0": (lambda: check_microbatches("gpipe", 0, 2), ValueError, "n_microbatches=0"),
    "batch not divisible": (lambda: check_batch_split(6, 4), ValueError, "batch_size=6 does not divide into n_microbatches=4"),
    "batch=0": (lambda: check_batch_split(0, 2), ValueError, "batch_size=0"),
}


@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
def test_bad_pipeline_argument(case: str) -> None:
    _check(PIPELINE_CASES[case])


def test_pipeline_schedule_this_torch_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    monkeypatch.delattr(pipelining, "ScheduleDualPipeV")
    _check((lambda: check_schedule("dualpipev", 2), ValueError, "schedule='dualpipev' needs torch.distributed.pipelining.ScheduleDualPipeV"))


# --- sequence and context parallel of HF models ------------------------------------------------------

_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
            n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1)  # fmt: skip


def _hf(model_type: str = "qwen3_moe", **changes: Any) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in HF_TINY.items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **{**fields, "num_local_experts": 4, **changes})
    return AutoModelForCausalLM.from_config(config)


def _enable_cp(model: torch.nn.Module) -> None:
    from lightning_moe.models.context_parallel import enable_context_parallel

    enable_context_parallel(model, None)


def _layout_check(model: torch.nn.Module, **options: bool) -> None:
    from lightning_moe.parallel.layout import FoldedLayout
    from lightning_moe.parallel.parallelize import check_model_for_layout

    check_model_for_layout(model, FoldedLayout(2, tp=2), **options)


HF_PARALLEL_CASES: dict[str, Case] = {
    "cp gpt-oss sinks": (lambda: _enable_cp(_hf("gpt_oss", layer_types=["full_attention"])), TypeError,
                         "(GptOssAttention) is attention that context parallelism cannot wrap: its attention adds per-head sinks"),
    "cp sliding window": (lambda: _enable_cp(_hf(use_sliding_window=True, sliding_window=8)), ValueError,
                          "has sliding_window=8; context parallelism computes causal attention over all keys"),
    "cp attention dropout": (lambda: _enable_cp(_hf(attention_dropout=0.1)), ValueError,
                             "has attention_dropout=0.1; context-parallel attention has no dropout"),
    "sp deepseek mla": (lambda: _layout_check(_hf("deepseek_v3", **_MLA), sequence_parallel=True), ValueError,
                        "sequence_parallel=True is not supported with model.layers.0.self_attn (DeepseekV3Attention)"),
    "vp hf model": (lambda: _layout_check(_hf(), vocab_parallel=True), ValueError,
                    "has neither. Turn vocab_parallel off for this model."),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HF_PARALLEL_CASES))
def test_bad_hf_parallel_model(case: str) -> None:
    pytest.importorskip("transformers")
    _check(HF_PARALLEL_CASES[case])


def test_hf_model_under_context_parallel_refuses_a_call_without_positions_or_with_a_mask(fake_world: Any) -> None:
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from lightning_moe.models.context_parallel import enable_context_parallel

    fake_world(0, 1)
    model = _hf()
    enable_context_parallel(model, dist.group.WORLD)
    ids = torch.zeros(1, 8, dtype=torch.long)
    _check((lambda: model(input_ids=ids), ValueError, "under context parallelism pass position_ids"))
    positions, mask = torch.arange(8)[None], torch.ones(1, 8, dtype=torch.long)
    _check((lambda: model(input_ids=ids, position_ids=positions, attention_mask=mask), ValueError,
            "attention_mask of shape (1, 8) is not supported under context parallelism"))  # fmt: skip
    enable_context_parallel(model, None)  # turned back: the model's own attention again
    assert model.config._attn_implementation == "sdpa" and model(input_ids=ids).logits.shape == (1, 8, 64)
