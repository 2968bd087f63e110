"""``hf_config_from``: one HF config from whichever form the caller holds, or an early error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from lightning_moe.models.hf_config import hf_config_from  # noqa: E402

INLINE = {"model_type": "qwen3_moe", "hidden_size": 32, "num_experts": 4, "vocab_size": 64}


def _fields(config: object) -> dict:
    """The config's values, without where it was read from."""
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def test_every_form_gives_the_same_config(tmp_path: Path) -> None:
    config = hf_config_from(INLINE)
    assert isinstance(config, transformers.Qwen3MoeConfig) and config.num_experts == 4
    config.save_pretrained(tmp_path)
    assert hf_config_from(config) is config
    for form in (str(tmp_path), tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        assert _fields(hf_config_from(form)) == _fields(config), form
    assert _fields(hf_config_from(pretrained=str(tmp_path))) == _fields(config)


def test_bad_input_is_refused_naming_the_value_and_the_owner(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HFMoELanguageModel: give exactly one of hf_config"):
        hf_config_from()
    with pytest.raises(ValueError, match="export: give exactly one of hf_config"):
        hf_config_from(INLINE, str(tmp_path), owner="export")
    with pytest.raises(ValueError, match=r"hf_config='.*other\.json' has no config.json"):
        hf_config_from(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match=r"pretrained='.*' has no config.json; pass a local directory"):
        hf_config_from(pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="model_type='nope' is not a model type"):
        hf_config_from({"model_type": "nope"})
    with pytest.raises(TypeError, match=r"hf_config=3 \(int\) is not a config"):
        hf_config_from(3)
