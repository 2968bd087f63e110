"""The Hugging Face model config of an HF MoE model, from whichever form the caller holds.

:func:`hf_config_from` is the one place a ``transformers.PretrainedConfig`` is made from user input:
the training module builds its model with it, and both exports (one process and streaming)
rebuild the model's skeleton with it. No hub access is ever attempted: a name that is not a local
directory is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["hf_config_from"]


def hf_config_from(
    hf_config: Any = None,
    pretrained: str | Path | None = None,
    *,
    owner: str = "HFMoELanguageModel",
) -> Any:
    """A transformers ``PretrainedConfig`` from exactly one of ``hf_config`` and ``pretrained``.

    ``hf_config`` may be a ``PretrainedConfig`` (returned as it is), an inline dict that contains
    ``model_type`` (e.g. ``{"model_type": "qwen3_moe", ...}``, as YAML gives it), or the path of a
    directory holding ``config.json`` or of the ``config.json`` itself. ``pretrained`` is a local
    checkpoint directory written by ``save_pretrained``. ``owner`` starts every error message.
    """
    from transformers import PretrainedConfig

    if (hf_config is None) == (pretrained is None):
        raise ValueError(
            f"{owner}: give exactly one of hf_config (a dict with model_type) and pretrained "
            f"(a local checkpoint directory); got hf_config={'set' if hf_config else None}, pretrained={pretrained!r}."
        )
    if pretrained is not None:
        return _from_directory(Path(pretrained), f"pretrained={str(pretrained)!r}", owner)
    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        return _from_directory(path.parent if path.name == "config.json" else path, f"hf_config={str(hf_config)!r}", owner)
    if isinstance(hf_config, dict):
        return _from_dict(hf_config, owner)
    raise TypeError(
        f"{owner}: hf_config={hf_config!r} ({type(hf_config).__name__}) is not a config; pass a dict with "
        "model_type, a PretrainedConfig, or a directory holding config.json."
    )


def _from_directory(directory: Path, what: str, owner: str) -> Any:
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise ValueError(
            f"{owner}: {what} has no config.json; pass a local directory written by save_pretrained "
            "(hub names are not fetched)."
        )
    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


def _from_dict(hf_config: dict[str, Any], owner: str) -> Any:
    from transformers import AutoConfig

    if "model_type" not in hf_config:
        raise ValueError(
            f"{owner}: hf_config has no model_type (keys: {sorted(hf_config)}); add e.g. model_type: qwen3_moe."
        )
    kwargs = dict(hf_config)
    model_type = kwargs.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as exc:
        if "Unrecognized model identifier" not in str(exc):
            raise
        raise ValueError(
            f"{owner}: hf_config model_type={model_type!r} is not a model type of this transformers; "
            "use an MoE family, e.g. qwen3_moe, qwen2_moe, mixtral or deepseek_v3."
        ) from None
