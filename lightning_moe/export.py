"""Export a trained checkpoint to a Hugging Face safetensors directory.

``lightning-moe-export CKPT OUT_DIR [--hf-config DIR_OR_JSON] [--dtype bfloat16] [--etp N]``

``torchrun --nproc_per_node=N -m lightning_moe.export DCP_DIR OUT_DIR --streaming [--ep E]``: no
process holds the whole model; each rank reads its shards of the DCP folder and writes its own
safetensors files, rank 0 the index (:func:`~lightning_moe.checkpoint.hf_stream_export.stream_export_dcp`).

Pipeline:

1. read   the model state dict and hyper-parameters from a Lightning ``.ckpt`` file, or from a
          distributed (DCP) checkpoint directory as the ``folded_moe`` / ``ModelParallelStrategy``
          writes it (``.metadata`` + shards, ``meta.pt`` with the hyper-parameters); sharded
          experts (DTensors) are read back whole, on one process, without a process group
          (:func:`~lightning_moe.checkpoint.read.load_checkpoint`, re-exported here).
2. strip  the LightningModule's attribute prefix (``model.`` for :class:`HFMoELanguageModel`).
3. build  the HF model skeleton on the ``meta`` device from the checkpoint's ``hf_config`` /
          ``pretrained`` hyper-parameter (or ``--hf-config``), swap its MoE blocks with the same
          ``moe`` overrides, and load the state dict into it (``strict``, ``assign``).
4. export ``export_moe_blocks`` puts HF blocks back (experts transposed to HF's layout) and
          ``save_pretrained`` writes ``config.json`` + ``model*.safetensors``, which
          ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads.

:func:`export_state_dict` is the library entry point and takes a state dict directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.dcp import W13_FORMAT, W13_FORMAT_KEY
from lightning_moe.checkpoint.manifest import MANIFEST_NAME
from lightning_moe.checkpoint.read import join_w13, load_checkpoint
from lightning_moe.models.hf_config import hf_config_from

__all__ = ["export_checkpoint", "export_state_dict", "from_stage_names", "join_w13", "load_checkpoint", "main", "strip_prefix"]


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Keys under ``prefix`` with it removed; raises if none carries it."""
    if not prefix:
        return dict(state_dict)
    out = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not out:
        raise ValueError(
            f"export: no state-dict key starts with prefix={prefix!r} (first keys: {list(state_dict)[:3]}); "
            "set --prefix to the LightningModule attribute that holds the model, or '' for none."
        )
    return out


def from_stage_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` under the HF model's names: a checkpoint saved at ``pp > 1`` names the
    parameters as the pipeline stages do (``embed.weight``, ``layers.N.*``, ``norm.weight``), mapped
    by :func:`~lightning_moe.models.hf_pipeline_stage.hf_parameter_name`; other state dicts unchanged."""
    from lightning_moe.models.hf_pipeline_stage import hf_parameter_name

    if not any(k.startswith(("embed.", "layers.", "norm.")) for k in state_dict):
        return state_dict
    return {hf_parameter_name(k): v for k, v in state_dict.items()}


def export_state_dict(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    hf_config: Any = None,
    pretrained: str | None = None,
    moe: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    etp: int = 1,
) -> Path:
    """Write an HF safetensors directory from the state dict of a *swapped* HF model.

    Args:
        state_dict: keys of the HF model after :func:`~lightning_moe.models.hf.swap_moe_blocks`
            (``model.layers.0.mlp.experts.w13``, ...), e.g. ``HFMoELanguageModel.model.state_dict()``,
            or the pipeline stages' names of a ``pp > 1`` checkpoint (:func:`from_stage_names`).
        out_dir: created if missing.
        hf_config: a ``PretrainedConfig``, an inline dict with ``model_type``, or a path to a
            directory / ``config.json`` (:func:`~lightning_moe.models.hf_config.hf_config_from`).
        pretrained: local checkpoint directory whose ``config.json`` describes the model; give
            exactly one of ``hf_config`` and ``pretrained``.
        moe: the MoEConfig overrides the model was swapped with (needed when they add keys).
        dtype: cast floating tensors before saving (``None`` keeps the checkpoint's dtypes).
        max_shard_size: passed to ``save_pretrained``.
        etp: expert tensor-parallel degree a one-file checkpoint was saved with (DCP folders
            with a manifest need none: they store ``w13`` as gate/up halves). A one-file
            ``folded_moe`` checkpoint stores ``w13`` column-blocked ``[gate_0|up_0|gate_1|up_1|...]`` when ``etp > 1``; it is
            reordered to ``[gate | up]`` here.
    """
    from transformers import AutoModelForCausalLM

    from lightning_moe.models.hf import export_moe_blocks, swap_moe_blocks

    if etp < 1:
        raise ValueError(f"export: etp={etp} must be >= 1 (the checkpoint's expert tensor-parallel degree).")
    if etp > 1:
        from lightning_moe.parallel.parallelize import unblock_w13

        blocked = ("experts.w13", "experts.b13")
        state_dict = {k: unblock_w13(v, etp) if k.endswith(blocked) else v for k, v in state_dict.items()}
    config = hf_config_from(hf_config, pretrained, owner="export")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    swap_moe_blocks(model, **(moe or {}))
    model.load_state_dict(from_stage_names(state_dict), strict=True, assign=True)
    export_moe_blocks(model)
    if dtype is not None:
        model.to(dtype=dtype)
    config.dtype = next(model.parameters()).dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out


def _stores_w13_layout_free(path: Path) -> bool:
    """A DCP folder with a manifest, or a one-file checkpoint with the ``w13_format`` marker: ``w13``
    is stored as ``[gate | up]`` whatever the layout it was trained at (a second un-blocking would
    scramble it)."""
    if path.is_dir():
        return (path / MANIFEST_NAME).is_file()
    ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)  # mapped: reads no tensor data
    return ckpt.get(W13_FORMAT_KEY) == W13_FORMAT


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    hf_config: Any = None,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    etp: int = 1,
) -> Path:
    """:func:`load_checkpoint` → :func:`strip_prefix` → :func:`export_state_dict`.

    The HF config comes from ``hf_config`` if given, else the checkpoint's ``hf_config`` /
    ``pretrained`` hyper-parameters (what :class:`~lightning_moe.lit_hf.HFMoELanguageModel` saves).
    """
    state_dict, hparams = load_checkpoint(checkpoint, owner="export")
    if etp != 1 and _stores_w13_layout_free(Path(checkpoint)):
        raise ValueError(
            f"export: etp={etp} is not needed for {checkpoint}: it stores w13 independently of the layout "
            "([gate | up]); drop --etp."
        )
    state_dict = strip_prefix(state_dict, prefix)
    pretrained = None
    if hf_config is None:
        hf_config, pretrained = hparams.get("hf_config"), hparams.get("pretrained")
        if hf_config is None and pretrained is None:
            raise ValueError(
                f"export: {checkpoint} names no HF config (no hf_config/pretrained hyper-parameter); pass --hf-config."
            )
    return export_state_dict(state_dict, out_dir, hf_config, pretrained, moe=hparams.get("moe"), dtype=dtype, etp=etp)


def main(argv: list[str] | None = None) -> None:
    """Console script ``lightning-moe-export``."""
    parser = argparse.ArgumentParser(
        prog="lightning-moe-export",
        description="Convert a Lightning .ckpt or DCP checkpoint of a swapped HF MoE model to HF safetensors.",
    )
    parser.add_argument("checkpoint", help="Lightning .ckpt file or distributed (DCP) checkpoint directory")
    parser.add_argument("out_dir", help="output directory (config.json + model*.safetensors)")
    parser.add_argument(
        "--hf-config", default=None, help="HF config directory or config.json (default: from the checkpoint)"
    )
    parser.add_argument("--prefix", default="model.", help="LightningModule attribute prefix of the model keys")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="cast before saving")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor-parallel degree of a folded_moe checkpoint")
    parser.add_argument("--streaming", action="store_true",
                        help="DCP folder under torchrun: every rank reads and writes only its part")  # fmt: skip
    parser.add_argument("--ep", type=int, default=None, help="with --streaming: ranks the experts are spread over")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.streaming:
        _main_streaming(args, dtype)
        return
    out = export_checkpoint(args.checkpoint, args.out_dir, args.hf_config, args.prefix, dtype, args.etp)
    print(f"exported {args.checkpoint} -> {out}", flush=True)


def _main_streaming(args: argparse.Namespace, dtype: torch.dtype | None) -> None:
    import torch.distributed as dist

    from lightning_moe.checkpoint.hf_stream_export import stream_export_dcp

    if not Path(args.checkpoint).is_dir():
        raise ValueError(f"export: --streaming reads a DCP folder; {args.checkpoint} is not a directory.")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")  # torchrun's environment; one rank without it
    try:
        out = stream_export_dcp(args.checkpoint, args.out_dir, group=dist.group.WORLD, hf_config=args.hf_config,
                                prefix=args.prefix, dtype=dtype, ep=args.ep)  # fmt: skip
        if dist.get_rank() == 0:
            print(f"exported {args.checkpoint} -> {out}", flush=True)
    finally:
        if started:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
