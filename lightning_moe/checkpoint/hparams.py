"""Hyper-parameter config dataclasses as plain dicts in checkpoints, rebuilt on load.

``torch.load(weights_only=True)`` refuses any class it has not been told about. A checkpoint's
``hyper_parameters`` hold :class:`~lightning_moe.config.MoEConfig`,
:class:`~lightning_moe.config.KernelConfig` and
:class:`~lightning_moe.models.transformer.TransformerConfig`; :func:`config_to_plain` stores
each as a dict of its fields with the class name under ``"__config__"``, and
:func:`config_from_plain` turns such dicts back into the dataclasses (only classes of
:func:`config_classes`, so loading never imports a name from the file).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["CONFIG_TAG", "config_classes", "config_from_plain", "config_to_plain"]

CONFIG_TAG = "__config__"


def config_classes() -> dict[str, type]:
    """Every config dataclass a checkpoint may hold, by class name."""
    from lightning_moe import config as config_module
    from lightning_moe.models import transformer

    out: dict[str, type] = {}
    for module in (config_module, transformer):
        for name in dir(module):
            obj = getattr(module, name)
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                out[obj.__name__] = obj
    return out


def config_to_plain(value: Any) -> Any:
    """``value`` with every config dataclass of :func:`config_classes` (nested in dicts, lists, tuples) as a tagged dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if config_classes().get(type(value).__name__) is not type(value):
            return value  # not one of ours: left as it is
        fields = {f.name: config_to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {CONFIG_TAG: type(value).__name__, **fields}
    if isinstance(value, dict):
        return {k: config_to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(config_to_plain(v) for v in value)
    return value


def config_from_plain(value: Any) -> Any:
    """Inverse of :func:`config_to_plain`; values without the tag pass through unchanged."""
    if isinstance(value, dict):
        inner = {k: config_from_plain(v) for k, v in value.items() if k != CONFIG_TAG}
        if CONFIG_TAG not in value:
            return inner
        name = value[CONFIG_TAG]
        classes = config_classes()
        if name not in classes:
            raise ValueError(
                f"checkpoint hyper_parameters: {CONFIG_TAG}={name!r} is not a lightning_moe config class "
                f"({sorted(classes)}); the checkpoint comes from another version: rebuild the config by hand."
            )
        return classes[name](**inner)
    if isinstance(value, (list, tuple)):
        return type(value)(config_from_plain(v) for v in value)
    return value
