"""MoEConfig: every broken rule raises ValueError at construction, naming the bad value."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lightning_moe.config import KernelConfig, MoEConfig

BASE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)

BAD_CONFIGS = {
    "top_k_exceeds_num_experts": (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    "hidden_size_zero": (dict(hidden_size=0), "hidden_size=0"),
    "num_experts_not_int": (dict(num_experts=8.0), "num_experts=8.0"),
    "top_k_negative": (dict(top_k=-1), "top_k=-1"),
    "num_experts_not_divisible_by_num_groups": (
        dict(num_experts=6, num_groups=4, group_topk=1),
        "num_experts=6 is not divisible by num_groups=4",
    ),
    "group_topk_exceeds_num_groups": (dict(num_groups=2, group_topk=3, top_k=3), "group_topk=3"),
    "group_topk_zero": (dict(num_groups=2, group_topk=0), "group_topk=0"),
    "num_groups_without_group_topk": (dict(num_groups=4), "num_groups=4 and group_topk=None"),
    "group_topk_without_num_groups": (dict(group_topk=2), "num_groups=None and group_topk=2"),
    "top_k_not_divisible_by_group_topk": (
        dict(num_groups=4, group_topk=2, top_k=3),
        "top_k=3 must be divisible by group_topk=2",
    ),
    "kept_groups_hold_fewer_than_top_k": (
        dict(num_experts=8, num_groups=4, group_topk=1, top_k=3),
        "group_topk=1 groups of 2 experts hold fewer than top_k=3",
    ),
    "capacity_factor_zero": (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    "capacity_factor_negative": (dict(capacity_factor=-1.5), "capacity_factor=-1.5"),
    "capacity_factor_nan": (dict(capacity_factor=float("nan")), "capacity_factor=nan"),
    "unknown_score_func": (dict(score_func="relu"), "score_func='relu'"),
    "unknown_aux_loss": (dict(aux_loss="gshard"), "aux_loss='gshard'"),
    "unknown_drop_policy": (dict(capacity_factor=1.0, drop_policy="random"), "drop_policy='random'"),
    "unknown_experts_backend": (dict(experts_backend="cutlass"), "experts_backend='cutlass'"),
    "experts_backend_te_is_gone": (dict(experts_backend="te"), "experts_backend='te'"),
    "unknown_router_dtype": (dict(router_dtype="float16"), "router_dtype='float16'"),
    "pad_to_capacity_without_capacity": (dict(pad_to_capacity=True), "pad_to_capacity=True needs a capacity"),
    "softmax_top1_without_pre_softmax": (dict(top_k=1), "top_k=1 and pre_softmax=False"),
    "negative_aux_loss_coeff": (dict(aux_loss_coeff=-0.01), "aux_loss_coeff=-0.01"),
    "negative_z_loss_coeff": (dict(z_loss_coeff=-1e-3), "z_loss_coeff=-0.001"),
    "shared_expert_ffn_size_zero": (dict(shared_expert_ffn_size=0), "shared_expert_ffn_size=0"),
    "shared_expert_gate_without_shared_expert": (dict(shared_expert_gate=True), "shared_expert_gate=True"),
    "shared_expert_overlap_without_shared_expert": (dict(shared_expert_overlap=True), "shared_expert_overlap=True"),
    "negative_bias_update_rate": (dict(bias_update_rate=-0.5), "bias_update_rate=-0.5"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_value_error_naming_the_value(case: str) -> None:
    overrides, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        MoEConfig(**{**BASE, **overrides})
    assert str(info.value).startswith("MoEConfig: ")


def test_num_groups_error_lists_valid_choices() -> None:
    with pytest.raises(ValueError, match=re.escape("choose num_groups from [1, 2, 3, 6]")):
        MoEConfig(**{**BASE, "num_experts": 6, "num_groups": 4, "group_topk": 1})


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(top_k=1, pre_softmax=True),
        dict(score_func="sigmoid", top_k=1),
        dict(top_k=8),
        dict(score_func="sigmoid", top_k=4, num_groups=4, group_topk=2, expert_bias=True, scaling_factor=2.5),
        dict(num_groups=1, group_topk=1),
        dict(capacity_factor=1.25, drop_policy="position", pad_to_capacity=True),
        dict(shared_expert_ffn_size=16, shared_expert_gate=True, z_loss_coeff=1e-3, aux_loss="global"),
    ],
    ids=[
        "defaults",
        "pre_softmax_top1",
        "sigmoid_top1",
        "top_k_equals_E",
        "deepseek_v3_like",
        "one_group",
        "padded_capacity",
        "shared_expert",
    ],
)
def test_valid_configs_construct(overrides: dict) -> None:
    cfg = MoEConfig(**{**BASE, **overrides})
    assert dataclasses.replace(cfg) == cfg


def test_defaults_are_dropless_softmax_with_switch_loss() -> None:
    cfg = MoEConfig(**BASE)
    assert cfg.capacity_factor is None and cfg.score_func == "softmax" and cfg.aux_loss == "switch"
    assert cfg.memory_efficient_permute and cfg.num_groups is None and not cfg.expert_bias


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("float64", torch.float64), ("bfloat16", torch.bfloat16)]
)
def test_router_torch_dtype(name: str, dtype: torch.dtype) -> None:
    assert MoEConfig(**BASE, router_dtype=name).router_torch_dtype is dtype


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        MoEConfig(16, 8, 8, 2)  # type: ignore[misc]


BAD_KERNELS = {
    "gemm": (dict(gemm="cublas"), "gemm='cublas' is not one of ('auto', 'torch', 'cutlass')"),
    "gemm_cutlass_tile": (dict(gemm_cutlass_tile="pingpong-128x128"), "gemm_cutlass_tile='pingpong-128x128' is not one of"),
    "wgrad": (dict(wgrad="cublaslt"), "wgrad='cublaslt' is not one of ('auto', 'loop', 'streams', 'cutlass')"),
    "wgrad_triton_removed": (dict(wgrad="triton"), "wgrad='triton' was removed; the grouped Triton weight-gradient kernel"),
    "wgrad_streams_w13": (dict(wgrad_streams_w13=0), "wgrad_streams_w13=0 must be an int >= 1"),
    "wgrad_streams_w2": (dict(wgrad_streams_w2=1.5), "wgrad_streams_w2=1.5 must be an int >= 1"),
    "wgrad_streams_bool": (dict(wgrad_streams_w2=True), "wgrad_streams_w2=True must be an int >= 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_KERNELS))
def test_bad_kernel_config_raises_naming_the_value(case: str) -> None:
    overrides, message = BAD_KERNELS[case]
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        KernelConfig(**overrides)
    assert str(info.value).startswith("KernelConfig: ")


def test_kernel_config_defaults_and_nesting() -> None:
    kernels = KernelConfig()
    assert (kernels.gemm, kernels.gemm_cutlass_tile, kernels.wgrad) == ("auto", "cooperative-128x256-c2x1", "auto")
    assert (kernels.wgrad_streams_w13, kernels.wgrad_streams_w2) == (2, 2)
    assert MoEConfig(**BASE).kernels == kernels
    assert MoEConfig(**BASE).kernels is not MoEConfig(**BASE).kernels  # one object per config
    from_dict = MoEConfig(**BASE, kernels={"gemm": "torch", "wgrad_streams_w2": 1})  # saved hyper-parameters
    assert from_dict.kernels == KernelConfig(gemm="torch", wgrad_streams_w2=1)
    assert MoEConfig(**dataclasses.asdict(from_dict)) == from_dict
    with pytest.raises(TypeError, match="MoEConfig: kernels='cutlass' is not a KernelConfig"):
        MoEConfig(**BASE, kernels="cutlass")
    with pytest.raises(ValueError, match=re.escape("KernelConfig: wgrad='tma' is not one of")):
        MoEConfig(**BASE, kernels={"wgrad": "tma"})
    with pytest.raises(TypeError):
        KernelConfig("auto")  # keyword-only


# The only environment variables the package reads: machine facts, each documented in ops/__init__.py.
MACHINE_ENV = {"LIGHTNING_MOE_KERNELS", "LIGHTNING_MOE_CACHE", "LIGHTNING_MOE_CUTLASS_DIR"}


def test_the_package_reads_only_documented_machine_level_environment_variables() -> None:
    from pathlib import Path

    import lightning_moe
    import lightning_moe.ops

    root = Path(lightning_moe.__file__).parent
    literal = re.compile(r"""os\.(?:environ(?:\.get\(|\[)|getenv\()\s*["']([A-Za-z0-9_]+)["']""")
    read: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        uses = text.count("os.environ") + text.count("os.getenv")
        names = literal.findall(text)
        assert len(names) == uses, f"{path.relative_to(root)}: an environment read without a literal name"
        for name in names:
            read.setdefault(name, set()).add(str(path.relative_to(root)))
    assert set(read) <= MACHINE_ENV, {n: sorted(p) for n, p in read.items() if n not in MACHINE_ENV}
    for name in MACHINE_ENV:
        assert name in (lightning_moe.ops.__doc__ or ""), f"{name} is not documented in lightning_moe/ops/__init__.py"


def test_kernel_choice_ignores_the_old_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values that would once have chosen (or broken) a kernel change nothing: the config decides."""
    from lightning_moe import MoELayer

    for name in ("LIGHTNING_MOE_GEMM_KERNEL", "LIGHTNING_MOE_WGRAD_KERNEL", "LIGHTNING_MOE_WGRAD_STREAMS",
                 "LIGHTNING_MOE_WGRAD_TILE", "LIGHTNING_MOE_WGRAD_CUTLASS_TILE", "LIGHTNING_MOE_GEMM_CUTLASS_TILE"):
        monkeypatch.setenv(name, "bogus")
    layer = MoELayer(MoEConfig(**BASE, fuse_wgrad_accumulation=True, kernels=KernelConfig(gemm="torch", wgrad="loop")))
    x = torch.randn(6, 16)
    for _ in range(2):
        layer(x).sum().backward()
    assert (layer.experts.gemm_kernel, layer.experts.wgrad_kernel) == ("torch", "loop")


def test_the_kernel_choice_is_saved_with_the_hyper_parameters() -> None:
    from _callback_models import tiny_config  # same folder: pytest puts it on sys.path

    from lightning_moe.lit import MoELanguageModel

    module = MoELanguageModel(tiny_config(kernels=KernelConfig(gemm="torch", wgrad_streams_w2=1)), log_layer_load=False)
    (transformer,) = [v for v in module.hparams.values() if hasattr(v, "moe")]  # the TransformerConfig argument
    saved = transformer.moe.kernels
    assert saved == KernelConfig(gemm="torch", wgrad_streams_w2=1)
    experts = [m for m in module.modules() if hasattr(m, "gemm_kernel")]
    assert experts and all(e.gemm_kernel == "torch" and e.wgrad_streams == (2, 1) for e in experts)
