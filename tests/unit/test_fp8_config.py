"""Fp8Config and MoEConfig.fp8: checks at construction, saved and YAML round trips, and the choice
the experts make from it on a device (``ops.fp8.expert_mlp.fp8_options``)."""

from __future__ import annotations

import dataclasses
import re
from typing import get_args

import pytest
import torch

from lightning_moe import config as config_module
from lightning_moe import MoELayer
from lightning_moe.config import Fp8Config, MoEConfig
from lightning_moe.ops.fp8 import expert_mlp as fp8_mlp
from lightning_moe.ops.fp8 import gemm as fp8_gemm
from lightning_moe.ops.fp8 import recipe as fp8_recipe

BASE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)

BAD = {
    "recipe": (dict(recipe="mxfp8"), ValueError, "recipe='mxfp8' is not one of ('tensorwise', 'rowwise', 'blockwise')"),
    "enabled": (dict(enabled=True), ValueError, "enabled=True is not one of ('on', 'auto', 'off')"),
    "backend": (dict(backend="te"), ValueError, "backend='te' is not one of ('auto', 'emulate', 'torch', 'cutlass')"),
    "grad_format": (dict(grad_format="e3m4"), ValueError, "grad_format='e3m4' is not one of ('e4m3', 'e5m2')"),
    "pow2_scales": (dict(pow2_scales=1), TypeError, "pow2_scales=1 is not a bool"),
    "save_fp8_activations": (dict(save_fp8_activations="yes"), TypeError, "save_fp8_activations='yes' is not a bool"),
    "dispatch": (dict(dispatch=None), TypeError, "dispatch=None is not a bool"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_config_names_the_value(case: str) -> None:
    overrides, error, message = BAD[case]
    with pytest.raises(error, match=re.escape(message)) as info:
        Fp8Config(**overrides)
    assert str(info.value).startswith("Fp8Config: ")


def test_defaults_and_keyword_only() -> None:
    cfg = Fp8Config()
    assert (cfg.recipe, cfg.enabled, cfg.backend, cfg.grad_format) == ("blockwise", "on", "auto", "e4m3")
    assert not cfg.pow2_scales and cfg.save_fp8_activations and cfg.dispatch
    assert MoEConfig(**BASE).fp8 is None  # bf16 experts by default
    with pytest.raises(TypeError):
        Fp8Config("rowwise")  # type: ignore[misc]


def test_the_config_literals_are_the_recipe_modules() -> None:
    assert get_args(config_module.Fp8Recipe) == get_args(fp8_recipe.Fp8Recipe)
    assert get_args(config_module.Fp8Format) == get_args(fp8_recipe.Fp8Format)
    assert set(get_args(config_module.Fp8Backend)) == {"auto", *get_args(fp8_gemm.Fp8GemmBackend)}


def test_moe_config_takes_a_dict_and_round_trips() -> None:
    cfg = MoEConfig(**BASE, fp8={"recipe": "rowwise", "grad_format": "e5m2"})  # saved hyper-parameters
    assert cfg.fp8 == Fp8Config(recipe="rowwise", grad_format="e5m2")
    assert MoEConfig(**dataclasses.asdict(cfg)) == cfg
    assert dataclasses.replace(cfg) == cfg
    with pytest.raises(TypeError, match=re.escape("MoEConfig: fp8='blockwise' is not an Fp8Config")):
        MoEConfig(**BASE, fp8="blockwise")
    with pytest.raises(ValueError, match=re.escape("Fp8Config: recipe='block' is not one of")):
        MoEConfig(**BASE, fp8={"recipe": "block"})


def test_yaml_round_trip_through_jsonargparse() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MoEConfig, "moe")
    text = """
moe:
  hidden_size: 16
  ffn_hidden_size: 8
  num_experts: 4
  top_k: 2
  fp8:
    recipe: rowwise
    enabled: auto
    backend: emulate
    pow2_scales: true
"""
    first = parser.instantiate_classes(parser.parse_string(text)).moe
    assert first.fp8 == Fp8Config(recipe="rowwise", enabled="auto", backend="emulate", pow2_scales=True)
    dumped = parser.dump(parser.parse_string(text))
    assert "pow2_scales: true" in dumped and "recipe: rowwise" in dumped
    again = parser.instantiate_classes(parser.parse_string(dumped)).moe
    assert again == first
    off = parser.instantiate_classes(parser.parse_string(text.split("  fp8:")[0])).moe
    assert off.fp8 is None
    with pytest.raises(Exception, match="recipe"):
        parser.instantiate_classes(parser.parse_string(text.replace("rowwise", "columnwise")))


def test_the_choice_is_saved_with_the_hyper_parameters() -> None:
    from _callback_models import tiny_config  # same folder: pytest puts it on sys.path

    from lightning_moe.lit import MoELanguageModel

    module = MoELanguageModel(tiny_config(fp8=Fp8Config(recipe="rowwise", backend="emulate")), log_layer_load=False)
    (transformer,) = [v for v in module.hparams.values() if hasattr(v, "moe")]
    assert transformer.moe.fp8 == Fp8Config(recipe="rowwise", backend="emulate")
    experts = [m for m in module.modules() if hasattr(m, "fp8_options")]
    assert experts and all(e.fp8 == transformer.moe.fp8 for e in experts)


# ---- the choice on a device -----------------------------------------------------------------------

CPU = torch.device("cpu")
WIDE, NARROW = (2880, 2880), (2048, 768)  # the measured shapes of fp8_pays


def test_fp8_pays_follows_the_measured_shapes() -> None:
    # the whole FP8 experts step measured slower than bf16 on every shape: auto keeps bf16
    for shape in (WIDE, NARROW, (7168, 2048), (4096, 14336)):
        assert not fp8_mlp.fp8_pays(*shape), shape
    doc = fp8_mlp.fp8_pays.__doc__ or ""
    assert "2880" in doc and "768" in doc and "1.6x" in doc and "81.9" in doc


def test_fp8_pays_applies_a_measured_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_mlp, "FP8_MIN_EXPERT_HF", 4 * 1024 * 1024)
    assert fp8_mlp.fp8_pays(*WIDE) and fp8_mlp.fp8_pays(7168, 2048)
    assert not fp8_mlp.fp8_pays(*NARROW)
    assert fp8_mlp.fp8_options(Fp8Config(enabled="auto", backend="emulate"), CPU, *WIDE) is not None


def test_on_cpu_fp8_needs_emulation() -> None:
    with pytest.raises(ValueError, match=re.escape("backend='emulate'")):
        fp8_mlp.fp8_options(Fp8Config(), CPU, *WIDE)
    opts = fp8_mlp.fp8_options(Fp8Config(backend="emulate", recipe="rowwise"), CPU, *NARROW)
    assert opts is not None and opts.backend == "emulate" and opts.recipe == "rowwise"


@pytest.mark.parametrize(
    ("fp8", "shape", "fp8_runs"),
    [
        (Fp8Config(enabled="auto"), WIDE, False),  # CPU without emulation: bf16
        (Fp8Config(enabled="auto", backend="emulate"), WIDE, False),  # no shape measured faster yet
        (Fp8Config(enabled="auto", backend="emulate"), NARROW, False),  # FP8 slower at this shape
        (Fp8Config(enabled="off", backend="emulate"), WIDE, False),
        (None, WIDE, False),
    ],
    ids=["auto-cpu", "auto-emulate-wide", "auto-emulate-narrow", "off", "none"],
)
def test_auto_and_off_on_cpu(fp8: Fp8Config | None, shape: tuple[int, int], fp8_runs: bool) -> None:
    assert (fp8_mlp.fp8_options(fp8, CPU, *shape) is not None) is fp8_runs


def test_a_gpu_without_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """enabled='on' refuses naming the capability; 'auto' (on a shape where FP8 pays) warns and keeps bf16."""
    monkeypatch.setattr(fp8_mlp, "FP8_MIN_EXPERT_HF", 4 * 1024 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="compute capability 8.9"):
        fp8_mlp.fp8_options(Fp8Config(), cuda, *WIDE)
    with pytest.warns(UserWarning, match="bf16 on this device"):
        assert fp8_mlp.fp8_options(Fp8Config(enabled="auto"), cuda, *WIDE) is None
    with pytest.raises(ValueError, match="blockwise recipe only"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        fp8_mlp.fp8_options(Fp8Config(recipe="rowwise", backend="cutlass"), cuda, *WIDE)


def test_the_layer_refuses_fp8_on_cpu_at_its_first_call_and_runs_bf16_under_auto() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    layer = MoELayer(MoEConfig(**BASE, fp8=Fp8Config()))
    with pytest.raises(ValueError, match="emulat"):
        layer(x)
    auto = MoELayer(MoEConfig(**BASE, fp8=Fp8Config(enabled="auto")))
    auto.load_state_dict(layer.state_dict())
    plain = MoELayer(MoEConfig(**BASE))
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(auto(x), plain(x), rtol=0, atol=0)
    assert auto.experts.fp8_options(x.device) is None
    assert "fp8='blockwise'" in repr(auto.experts)


def test_experts_name_the_rows_they_take_from_the_exchange() -> None:
    layer = MoELayer(MoEConfig(**BASE, fp8=Fp8Config(recipe="rowwise", backend="emulate", pow2_scales=True)))
    assert layer.experts.fp8_rows(CPU) == ("rowwise", "e4m3", True)
    no_dispatch = MoELayer(MoEConfig(**BASE, fp8=Fp8Config(backend="emulate", dispatch=False)))
    assert no_dispatch.experts.fp8_rows(CPU) is None
    assert MoELayer(MoEConfig(**BASE)).experts.fp8_rows(CPU) is None
    tensorwise = MoELayer(MoEConfig(**BASE, fp8=Fp8Config(recipe="tensorwise", backend="emulate")))
    assert tensorwise.experts.fp8_rows(CPU) is None
