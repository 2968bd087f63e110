"""FP8 for a model's dense layers: attention projections, dense MLPs, shared experts.

``TransformerConfig(fp8_dense=...)`` chooses, once the experts' ``MoEConfig.fp8`` is set:

* ``"off"`` (default): dense layers in the activation dtype; only the experts run FP8.
* ``"on"``: every eligible ``nn.Linear`` becomes an :class:`~lightning_moe.ops.fp8.linear.Fp8Linear`
  with the experts' recipe, formats and backend (``ops/fp8/linear.py``): the same recipes on every
  device, blockwise included, emulated on CPU, and it composes with tensor parallelism.
* ``"torchao"``: torchao's float8 training (``torchao.float8.convert_to_float8_training``), the
  maintained library with ``torch.compile`` fusion of the casts and FP8 all-gather under FSDP2;
  tensorwise and rowwise recipes, CUDA only. Refused, with the reason, where it cannot run.

Eligible: ``nn.Linear`` layers without bias whose width and height are multiples of 16 (the FP8
tensor-core GEMMs' rule), except the output head and the router (numerically sensitive, as in
DeepSeek-V3's FP8 recipe) and one-output gates.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn as nn

from lightning_moe.ops.fp8.expert_mlp import Fp8Options
from lightning_moe.ops.fp8.gemm import resolve_fp8_backend
from lightning_moe.ops.fp8.linear import Fp8Linear

__all__ = ["DENSE_FP8_CHOICES", "DenseFp8", "convert_linears_to_fp8", "dense_fp8_options", "eligible_linears"]

DenseFp8 = Literal["off", "on", "torchao"]
DENSE_FP8_CHOICES: tuple[str, ...] = ("off", "on", "torchao")
_SKIPPED = ("lm_head", "router", "embed")


def dense_fp8_options(fp8: Any, device: torch.device) -> Fp8Options | None:
    """The dense layers' settings from the experts' ``Fp8Config`` on ``device`` (``None``: stay bf16).

    ``enabled="auto"`` keeps them in the activation dtype where FP8 cannot run (CPU without
    ``backend="emulate"``, GPUs before sm_89); ``"on"`` raises there, naming the fix."""
    if fp8 is None or fp8.enabled == "off":
        return None
    try:
        backend = resolve_fp8_backend(fp8.backend, device, fp8.recipe)
    except ValueError:
        if fp8.enabled == "auto":
            return None
        raise
    return Fp8Options(fp8.recipe, fp8.grad_format, fp8.pow2_scales, backend, False)


def eligible_linears(model: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    """``(name, module)`` of every dense ``nn.Linear`` FP8 may run (see the module docstring)."""
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module.bias is not None:
            continue
        if any(part in _SKIPPED for part in name.split(".")) or module.out_features == 1:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        yield name, module


def convert_linears_to_fp8(model: nn.Module, mode: str, fp8: Any, device: torch.device | str | None = None) -> int:
    """Swap the eligible dense layers of ``model`` to FP8 in place; returns how many were converted.

    ``mode``: ``"off"``, ``"on"`` or ``"torchao"`` (``TransformerConfig.fp8_dense``); ``fp8``: the
    experts' ``Fp8Config`` (required unless ``mode="off"``). ``"on"`` resolves the backend on the
    device of each call; ``"torchao"`` converts for CUDA (``device``, default ``"cuda"``)."""
    if mode not in DENSE_FP8_CHOICES:
        raise ValueError(f"fp8_dense={mode!r} is unknown; choose one of {DENSE_FP8_CHOICES}.")
    if mode == "off":
        return 0
    if fp8 is None:
        raise ValueError(
            f"fp8_dense={mode!r} takes its recipe from the experts' MoEConfig.fp8, which is None; "
            "set moe.fp8=Fp8Config(...) or fp8_dense='off'."
        )
    if mode == "torchao":
        return _convert_with_torchao(model, fp8, torch.device(device or "cuda"))
    resolve = functools.partial(dense_fp8_options, fp8)
    count = 0
    for _, module in list(eligible_linears(model)):
        module.__class__ = Fp8Linear  # same parameters, same state-dict keys
        module.fp8_resolve = resolve  # type: ignore[attr-defined]
        count += 1
    return count


def _convert_with_torchao(model: nn.Module, fp8: Any, device: torch.device) -> int:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ValueError(
            "fp8_dense='torchao' needs torchao (pip install torchao); it is not importable here "
            f"({err}). Use fp8_dense='on' for lightning-moe's own FP8 dense layers."
        ) from None
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            "fp8_dense='torchao' runs on CUDA only and no CUDA device is available here; use fp8_dense='on' with "
            "Fp8Config(backend='emulate') on CPU."
        )
    if fp8.recipe not in ("tensorwise", "rowwise"):
        raise ValueError(
            f"fp8_dense='torchao' takes the recipes tensorwise and rowwise, not {fp8.recipe!r}; "
            "use fp8_dense='on' for blockwise dense layers."
        )
    names = {name for name, _ in eligible_linears(model)}
    config = Float8LinearConfig.from_recipe_name(fp8.recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in names)
    return len(names)
