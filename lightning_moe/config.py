"""Typed configuration of an MoE layer.

Plain values only (int, float, bool, ``Literal``, ``None`` for "off"), so that LightningCLI and
``--print_config`` round-trip it. Every rule is checked in ``__post_init__`` and a broken rule is
reported as ``MoEConfig: field=value breaks rule; fix.``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_moe.checks import (
    FieldRule,
    bool_field,
    check_fields,
    choice_field,
    float_field,
    int_field,
)

__all__ = [
    "AuxLossType",
    "DropPolicy",
    "ExpertsBackend",
    "Fp8Backend",
    "Fp8Config",
    "Fp8Enabled",
    "Fp8Format",
    "Fp8Recipe",
    "Fp8Wgrad",
    "GemmCutlassTile",
    "GemmKernel",
    "KernelConfig",
    "MoEConfig",
    "RouterDtype",
    "ScoreFunc",
    "WgradKernel",
]

# Each choice is declared once, as a ``Literal``; the checks read its values with ``typing.get_args``.
ScoreFunc = Literal["softmax", "sigmoid"]
AuxLossType = Literal["none", "switch", "seq", "global"]
DropPolicy = Literal["probs", "position"]
ExpertsBackend = Literal["auto", "torch", "loop", "grouped_gemm"]
RouterDtype = Literal["float32", "float64", "bfloat16"]

GemmKernel = Literal["auto", "torch", "cutlass"]
GemmCutlassTile = Literal["cooperative-128x256-c2x1", "pingpong-64x256"]
WgradKernel = Literal["auto", "loop", "streams", "cutlass"]

# The FP8 recipes and formats of ``lightning_moe.ops.fp8.recipe`` (which imports them from here, so that
# the configuration imports no torch).
Fp8Recipe = Literal["tensorwise", "rowwise", "blockwise"]
Fp8Format = Literal["e4m3", "e5m2"]  # torch.float8_e4m3fn / torch.float8_e5m2
Fp8Enabled = Literal["on", "auto", "off"]
Fp8Backend = Literal["auto", "emulate", "torch", "cutlass"]
Fp8Wgrad = Literal["auto", "fp8", "activation"]


@dataclass(kw_only=True)
class KernelConfig:
    """Which kernels the experts' GEMMs run (``MoEConfig(kernels=KernelConfig(...))``).

    Read once, when the layer is built; the defaults are the measured-fastest choice per shape. The
    optional CUTLASS kernels (sm_90 and the CUTLASS headers) are used only where they can run; elsewhere the torch path runs whatever is asked for.

    Args:
        gemm: the experts' forward and data-gradient GEMMs of the ``torch`` experts backend.
            ``auto``: the CUTLASS grouped GEMM with ping-pong 64 x 256 tiles for wide experts with
            few rows each (expert matrices of at least 16 MB and at most 768 rows an expert on
            average: DeepSeek-V3), ``F.grouped_mm`` otherwise; ``torch``: always ``F.grouped_mm``;
            ``cutlass``: the CUTLASS grouped GEMM wherever it applies, with ``gemm_cutlass_tile``.
        gemm_cutlass_tile: the tiling of ``gemm='cutlass'``: ``cooperative-128x256-c2x1`` (the
            tiling torch's ``grouped_mm`` uses on sm_90) or ``pingpong-64x256`` (what ``auto`` runs).
        wgrad: the expert weight-gradient kernel when ``MoEConfig.fuse_wgrad_accumulation`` adds
            into an existing ``.grad``. ``auto``: the CUTLASS grouped kernel (beta = 1) for narrow
            experts where it is available, else per-expert cuBLAS GEMMs (beta = 1) dealt over
            ``wgrad_streams_*`` CUDA streams from 16 experts on, in one stream below;
            ``loop``: per-expert cuBLAS GEMMs in one stream; ``streams``: the same over
            ``wgrad_streams_*`` streams; ``cutlass``: the CUTLASS grouped kernel for every width.
            Fresh gradients (``.grad`` is ``None``) are written by ``F.grouped_mm`` whatever is
            asked for (``docs/kernels.md`` has the measurements).
        wgrad_streams_w13: CUDA streams of the ``streams`` kernel for the up-projection ``w13``.
        wgrad_streams_w2: the same for the down-projection ``w2``.
    """

    gemm: GemmKernel = "auto"
    gemm_cutlass_tile: GemmCutlassTile = "cooperative-128x256-c2x1"
    wgrad: WgradKernel = "auto"
    wgrad_streams_w13: int = 2
    wgrad_streams_w2: int = 2

    def __post_init__(self) -> None:
        check_fields("KernelConfig", self, _KERNEL_RULES)


_TRITON_WGRAD_REMOVED = (
    "the grouped Triton weight-gradient kernel was no faster than the kernels 'auto' picks on the H200; "
    "use wgrad='auto' (or 'cutlass', 'streams', 'loop')"
)

_KERNEL_RULES: tuple[FieldRule, ...] = (
    choice_field("gemm", GemmKernel),
    choice_field("gemm_cutlass_tile", GemmCutlassTile),
    choice_field("wgrad", WgradKernel, removed={"triton": _TRITON_WGRAD_REMOVED}),
    int_field("wgrad_streams_w13", fix="set 1 (one stream) or more"),
    int_field("wgrad_streams_w2", fix="set 1 (one stream) or more"),
)


@dataclass(kw_only=True)
class Fp8Config:
    """FP8 expert GEMMs (``MoEConfig(fp8=Fp8Config(...))``; ``MoEConfig.fp8=None`` keeps them in bf16).

    Both expert projections run forward and backward (data and weight gradients) with FP8
    operands and fp32 accumulation; the master weights, the optimizer and everything outside the
    expert GEMMs stay as they are. The weights are quantized from the master copy (see
    ``cache_weights`` for how often).

    Args:
        recipe: the scaling units. ``blockwise`` (DeepSeek-V3): 1 x 128 tiles for activations and
            gradients, 128 x 128 tiles for weights; ``rowwise``: one scale per row of an activation
            and per column of a weight; ``tensorwise``: one scale per tensor (per expert for weights).
        enabled: ``on``; ``off`` (bf16, as with ``fp8=None``); ``auto``: FP8 only where it is
            faster for the experts' shape, bf16 elsewhere (``lightning_moe.ops.fp8.expert_mlp.fp8_pays``
            has the rule and its measurements), and bf16 on a device without FP8 tensor cores
            (CPU, CUDA before sm_89), unless ``backend='emulate'`` was asked for.
        backend: who runs the FP8 GEMMs. ``auto``: the fastest runnable on the device
            (CUDA sm_89+); ``torch``: ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``;
            ``cutlass``: the CUTLASS blockwise grouped kernel; ``emulate``: dequantize and run the
            GEMM in fp32 (same numbers, any device: the only one on CPU).
        grad_format: the FP8 format of the gradients in backward: ``e4m3`` (DeepSeek-V3, with the
            fine-grained recipes) or ``e5m2`` (more range, less precision: the usual one with ``tensorwise``).
        pow2_scales: round every scale up to a power of two (exact dequantization).
        save_fp8_activations: keep the experts' saved inputs (the rows and the SwiGLU input) in FP8
            for backward instead of in the activation dtype (about half the memory).
        dispatch: quantize the rows before the token exchange, where the dispatcher can carry FP8
            rows (half the bytes on the wire); the gradients of the exchange stay in high precision.
        wgrad: the weight-gradient GEMMs. ``fp8``: both operands quantized along each expert's rows
            (DeepSeek-V3); ``activation``: the unquantized operands in the activation dtype (the bf16
            experts' kernel); ``auto``: ``fp8`` on ``backend='emulate'``, ``activation`` on the GPU
            backends (``lightning_moe.ops.fp8.choice.resolve_wgrad_precision`` has the reason).
        cache_weights: keep each weight's FP8 copies (forward and data-gradient operands) until the
            weight changes (its version or an optimizer step), so that backward and the further
            micro-batches of a step reuse them (about 2 bytes per expert parameter stay allocated);
            ``False`` quantizes in every call and keeps nothing.
    """

    recipe: Fp8Recipe = "blockwise"
    enabled: Fp8Enabled = "on"
    backend: Fp8Backend = "auto"
    grad_format: Fp8Format = "e4m3"
    pow2_scales: bool = False
    save_fp8_activations: bool = True
    dispatch: bool = True
    wgrad: Fp8Wgrad = "auto"
    cache_weights: bool = True

    def __post_init__(self) -> None:
        check_fields("Fp8Config", self, _FP8_RULES)


_FP8_RULES: tuple[FieldRule, ...] = (
    choice_field("recipe", Fp8Recipe),
    choice_field("enabled", Fp8Enabled),
    choice_field("backend", Fp8Backend),
    choice_field("grad_format", Fp8Format),
    choice_field("wgrad", Fp8Wgrad),
    bool_field("pow2_scales"),
    bool_field("save_fp8_activations"),
    bool_field("dispatch"),
    bool_field("cache_weights"),
)


@dataclass(kw_only=True)
class MoEConfig:
    """One MoE FFN layer: router, experts, optional shared expert.

    Args:
        hidden_size: model width H.
        ffn_hidden_size: per-expert FFN width F (SwiGLU: gate and up are each F wide).
        num_experts: routed experts E.
        top_k: experts per token K.
        score_func: ``softmax`` or ``sigmoid`` scores from the router logits.
        pre_softmax: softmax over all E before top-k (required for ``top_k=1`` with softmax);
            otherwise softmax runs over the K selected logits.
        norm_topk_prob: renormalise the K selected weights to sum to one (sigmoid, or softmax
            with ``pre_softmax``); softmax over the K logits is already normalised.
        scaling_factor: multiply the routing weights by this value; ``None`` leaves them.
        num_groups: expert groups for group-limited routing (DeepSeek-V3); ``None`` is off.
        group_topk: groups kept per token when ``num_groups`` is set.
        group_score_topk: how many of a group's best scores sum to its group score; ``None``
            is ``top_k // group_topk`` (DeepSeek-V3: 2). DeepSeek-V2's ``group_limited_greedy``
            scores a group by its best expert (1).
        router_dtype: dtype of the router GEMM and scores.
        router_bias: the router has a learned bias, ``logits = x @ W^T + b`` (gpt-oss); it moves
            selection and weights alike (unlike ``expert_bias``).
        expert_bias: aux-loss-free balancing bias added to scores for selection only.
        bias_update_rate: step of ``b += rate * sign(mean(c) - c_i)`` after each optimizer step.
        aux_loss: load-balancing loss: ``switch`` (per micro-batch), ``seq`` (per sequence),
            ``global`` (counts summed over data-parallel ranks), or ``none``.
        aux_loss_coeff: weight of the load-balancing loss.
        z_loss_coeff: weight of the router z-loss; ``None`` is off.
        capacity_factor: expert capacity ``ceil(T*K/E * capacity_factor)``; ``None`` is dropless.
        drop_policy: which tokens an over-full expert keeps: ``probs`` (highest score) or
            ``position`` (earliest).
        pad_to_capacity: pad every expert to its capacity so shapes are static.
        shared_expert_ffn_size: FFN width of an always-on shared expert; ``None`` is off.
        shared_expert_gate: scale the shared expert's output by ``sigmoid(x @ g)``.
        shared_expert_overlap: on CUDA, run the shared expert on a side stream, concurrently with
            the routed path (its token exchange under expert parallelism), forward and backward.
        memory_efficient_permute: apply the routing weight inside the expert activation, so the
            combine is a plain sum and nothing extra is saved for the weight's gradient.
        routing_weight_on_input: multiply each routed row by its routing weight *before* the
            experts, ``y = sum_k expert_k(w_k * x)`` (Llama 4), instead of weighting their outputs;
            runs the dispatch → experts → combine stages separately (not the fused path).
        expert_mlp_bias: the routed experts' projections have biases, ``y_e = act(x @ W_13 + b_13)
            @ W_down + b_down`` (gpt-oss; the down bias is weighted with the output); every GEMM
            backend computes them, FP8 experts do not (refused).
        swiglu_alpha: the gate's sigmoid scale of the routed experts' SwiGLU,
            ``act = g * sigmoid(alpha * g) * (u + swiglu_up_offset)`` (1: ``silu``; gpt-oss: 1.702).
        swiglu_limit: clamp the gate to ``<= limit`` and the up projection to ``[-limit, limit]``
            before the activation; ``None`` is off (gpt-oss: 7.0).
        swiglu_up_offset: added to the (clamped) up projection (gpt-oss: 1.0).
            Any of the three off their defaults runs the activation in torch (not the csrc kernel)
            and is refused with FP8 experts; the shared expert keeps the plain SwiGLU.
        experts_backend: grouped GEMM backend; ``auto`` picks the fastest importable one.
        fuse_wgrad_accumulation: when an expert weight already holds a gradient (gradient
            accumulation over micro-batches), add the new one into ``.grad`` inside the
            weight-gradient GEMMs instead of through a separate addition (wide experts only:
            DeepSeek-V3, Mixtral; experts of this rank held as plain parameters, not expert-parallel
            shards). Not under ``DistributedDataParallel``, FSDP1 or DeepSpeed, whose hooks on the
            gradient accumulator would not run (``ops/wgrad/``).
        check_finite: raise, naming the layer, when router logits are not finite.
        init_std: standard deviation of the normal initialisation of all weights.
        kernels: which GEMM and weight-gradient kernels the experts run (:class:`KernelConfig`).
        fp8: FP8 expert GEMMs (:class:`Fp8Config`); ``None`` (the default) keeps them in the
            activation dtype.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    pre_softmax: bool = False
    norm_topk_prob: bool = True
    scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int | None = None
    router_dtype: RouterDtype = "float32"
    router_bias: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    aux_loss: AuxLossType = "switch"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    pad_to_capacity: bool = False
    shared_expert_ffn_size: int | None = None
    shared_expert_gate: bool = False
    shared_expert_overlap: bool = False
    memory_efficient_permute: bool = True
    routing_weight_on_input: bool = False
    expert_mlp_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None
    swiglu_up_offset: float = 0.0
    experts_backend: ExpertsBackend = "auto"
    fuse_wgrad_accumulation: bool = False
    check_finite: bool = False
    init_std: float = 0.02
    kernels: KernelConfig = field(default_factory=KernelConfig)
    fp8: Fp8Config | None = None

    def __post_init__(self) -> None:
        self._build_nested()
        check_fields("MoEConfig", self, _MOE_RULES)
        for rule in _MOE_CROSS_FIELD_RULES:
            rule(self)

    def _build_nested(self) -> None:
        """``kernels`` and ``fp8`` from a dict (saved hyper-parameters, a plain mapping), type-checked."""
        if isinstance(self.kernels, dict):
            self.kernels = KernelConfig(**self.kernels)
        if not isinstance(self.kernels, KernelConfig):
            raise TypeError(
                f"MoEConfig: kernels={self.kernels!r} is not a KernelConfig; "
                "pass KernelConfig(...) or a dict of its fields."
            )
        if isinstance(self.fp8, dict):
            self.fp8 = Fp8Config(**self.fp8)
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(
                f"MoEConfig: fp8={self.fp8!r} is not an Fp8Config; pass Fp8Config(...), a dict of its fields, "
                "or None for bf16 experts."
            )

    @property
    def plain_experts(self) -> bool:
        """The routed experts are ``silu(gate) * up`` without biases (what every kernel computes)."""
        return (
            not self.expert_mlp_bias
            and self.swiglu_alpha == 1.0
            and self.swiglu_limit is None
            and self.swiglu_up_offset == 0.0
        )

    @property
    def router_torch_dtype(self):  # noqa: ANN201 - torch imported lazily to keep config import-light
        import torch

        return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[self.router_dtype]


_MOE_RULES: tuple[FieldRule, ...] = (
    int_field("hidden_size"),
    int_field("ffn_hidden_size"),
    int_field("num_experts"),
    int_field("top_k"),
    choice_field("score_func", ScoreFunc),
    bool_field("pre_softmax"),
    bool_field("norm_topk_prob"),
    float_field("scaling_factor", strict=True, optional=True, fix="use e.g. 2.5, or None to leave the weights"),
    int_field("num_groups", optional=True, fix="set a divisor of num_experts, or None for both"),
    int_field("group_topk", optional=True, fix="set 1 to num_groups, or None for both"),
    int_field("group_score_topk", optional=True, fix="use 1 or more, or None for top_k // group_topk"),
    choice_field("router_dtype", RouterDtype),
    bool_field("router_bias"),
    bool_field("expert_bias"),
    float_field("bias_update_rate", fix="use 0 or more, e.g. 1e-3"),
    choice_field("aux_loss", AuxLossType),
    float_field("aux_loss_coeff", fix="use 0 or more (0 turns it off)"),
    float_field("z_loss_coeff", optional=True, fix="use 0 or more, or None for off"),
    float_field("capacity_factor", strict=True, optional=True, fix="use e.g. 1.25, or None for dropless"),
    choice_field("drop_policy", DropPolicy),
    bool_field("pad_to_capacity"),
    int_field("shared_expert_ffn_size", optional=True, fix="set a width, or None for off"),
    bool_field("shared_expert_gate"),
    bool_field("shared_expert_overlap"),
    bool_field("memory_efficient_permute"),
    bool_field("routing_weight_on_input"),
    bool_field("expert_mlp_bias"),
    float_field("swiglu_alpha", strict=True, fix="use e.g. 1.0 (silu) or 1.702"),
    float_field("swiglu_limit", strict=True, optional=True, fix="use e.g. 7.0, or None for no clamp"),
    float_field("swiglu_up_offset", minimum=None, fix="use e.g. 0.0 or 1.0"),
    choice_field("experts_backend", ExpertsBackend),
    bool_field("fuse_wgrad_accumulation"),
    bool_field("check_finite"),
    float_field("init_std", strict=True, fix="use e.g. 0.02"),
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _top_k_within_experts(c: MoEConfig) -> None:
    if c.top_k > c.num_experts:
        raise ValueError(
            f"MoEConfig: top_k={c.top_k} exceeds num_experts={c.num_experts}; choose top_k <= {c.num_experts}."
        )


def _router_gets_a_gradient(c: MoEConfig) -> None:
    if c.score_func == "softmax" and c.top_k == 1 and not c.pre_softmax:
        raise ValueError(
            "MoEConfig: score_func='softmax' with top_k=1 and pre_softmax=False gives every token weight 1 "
            "and the router no gradient; set pre_softmax=True."
        )


def _groups_set_together(c: MoEConfig) -> None:
    if c.num_groups is None and c.group_topk is None:
        if c.group_score_topk is not None:
            raise ValueError(
                f"MoEConfig: group_score_topk={c.group_score_topk!r} needs group-limited routing; set "
                "num_groups and group_topk, or leave group_score_topk=None."
            )
    elif c.num_groups is None or c.group_topk is None:
        raise ValueError(
            f"MoEConfig: num_groups={c.num_groups} and group_topk={c.group_topk} must be set together; "
            "set both or neither."
        )


def _groups_divide_experts(c: MoEConfig) -> None:
    if c.num_groups is not None and c.num_experts % c.num_groups != 0:
        raise ValueError(
            f"MoEConfig: num_experts={c.num_experts} is not divisible by num_groups={c.num_groups}; "
            f"choose num_groups from {_divisors(c.num_experts)}."
        )


def _kept_groups_supply_top_k(c: MoEConfig) -> None:
    """The ``group_topk`` kept groups hold ``top_k`` experts, and each can give its share of them."""
    if c.num_groups is None or c.group_topk is None:
        return
    if c.group_topk > c.num_groups:
        raise ValueError(
            f"MoEConfig: group_topk={c.group_topk} must be in [1, num_groups={c.num_groups}]; lower group_topk."
        )
    if c.group_score_topk is None and c.top_k % c.group_topk != 0:
        raise ValueError(
            f"MoEConfig: top_k={c.top_k} must be divisible by group_topk={c.group_topk} "
            "(each kept group scores with its top top_k/group_topk experts); choose group_topk from "
            f"{[d for d in _divisors(c.top_k) if d <= c.num_groups]}, or set group_score_topk."
        )
    experts_per_group = c.num_experts // c.num_groups
    if c.group_topk * experts_per_group < c.top_k:
        raise ValueError(
            f"MoEConfig: group_topk={c.group_topk} groups of {experts_per_group} experts hold fewer than "
            f"top_k={c.top_k} experts; raise group_topk."
        )
    if c.group_score_topk is None and c.top_k // c.group_topk > experts_per_group:
        raise ValueError(
            f"MoEConfig: top_k/group_topk={c.top_k // c.group_topk} exceeds the {experts_per_group} "
            "experts of one group; raise group_topk."
        )
    if c.group_score_topk is not None and c.group_score_topk > experts_per_group:
        raise ValueError(
            f"MoEConfig: group_score_topk={c.group_score_topk} exceeds the {experts_per_group} experts of one "
            f"group; choose 1 to {experts_per_group}, or None for top_k // group_topk."
        )


def _padding_has_a_capacity(c: MoEConfig) -> None:
    if c.pad_to_capacity and c.capacity_factor is None:
        raise ValueError("MoEConfig: pad_to_capacity=True needs a capacity; set capacity_factor (e.g. 1.25).")


def _shared_expert_options_have_one(c: MoEConfig) -> None:
    if c.shared_expert_ffn_size is not None:
        return
    if c.shared_expert_gate:
        raise ValueError("MoEConfig: shared_expert_gate=True needs shared_expert_ffn_size; set it or drop the gate.")
    if c.shared_expert_overlap:
        raise ValueError(
            "MoEConfig: shared_expert_overlap=True needs a shared expert; set shared_expert_ffn_size or drop "
            "the overlap."
        )


def _fp8_experts_compute_it(c: MoEConfig) -> None:
    """FP8 experts quantize the rows before any routing weight and run only the plain SwiGLU."""
    if c.fp8 is None:
        return
    if c.routing_weight_on_input:
        raise ValueError(
            "MoEConfig: routing_weight_on_input=True with fp8 experts: the FP8 rows are quantized before the "
            "weight would scale them; set fp8=None or routing_weight_on_input=False."
        )
    if c.fp8.enabled != "off" and not c.plain_experts:
        raise ValueError(
            f"MoEConfig: fp8 experts compute neither expert biases nor a scaled or clamped SwiGLU "
            f"(expert_mlp_bias={c.expert_mlp_bias}, swiglu_alpha={c.swiglu_alpha}, "
            f"swiglu_limit={c.swiglu_limit}, swiglu_up_offset={c.swiglu_up_offset}); set fp8=None."
        )


# The rules between fields, checked in this order once every field passed its own row of _MOE_RULES.
_MOE_CROSS_FIELD_RULES = (
    _top_k_within_experts,
    _router_gets_a_gradient,
    _groups_set_together,
    _groups_divide_experts,
    _kept_groups_supply_top_k,
    _padding_has_a_capacity,
    _shared_expert_options_have_one,
    _fp8_experts_compute_it,
)
