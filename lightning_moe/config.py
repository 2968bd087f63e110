"""Typed configuration of an MoE layer.

Plain values only (int, float, bool, ``Literal``, ``None`` for "off"), so that LightningCLI and
``--print_config`` round-trip it. Every rule is checked in ``__post_init__`` and a broken rule is
reported as ``MoEConfig: field=value breaks rule; fix.``
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "AuxLossType",
    "DropPolicy",
    "ExpertsBackend",
    "Fp8Backend",
    "Fp8Config",
    "Fp8Enabled",
    "Fp8Format",
    "Fp8Recipe",
    "GemmCutlassTile",
    "GemmKernel",
    "KernelConfig",
    "MoEConfig",
    "ScoreFunc",
    "WgradKernel",
    "check_bool",
    "check_float",
    "check_int",
]

ScoreFunc = Literal["softmax", "sigmoid"]
AuxLossType = Literal["none", "switch", "seq", "global"]
DropPolicy = Literal["probs", "position"]
ExpertsBackend = Literal["auto", "torch", "loop", "grouped_gemm"]
RouterDtype = Literal["float32", "float64", "bfloat16"]

_SCORE_FUNCS = ("softmax", "sigmoid")
_AUX_LOSSES = ("none", "switch", "seq", "global")
_DROP_POLICIES = ("probs", "position")
_BACKENDS = ("auto", "torch", "loop", "grouped_gemm")
_ROUTER_DTYPES = ("float32", "float64", "bfloat16")

GemmKernel = Literal["auto", "torch", "cutlass"]
GemmCutlassTile = Literal["cooperative-128x256-c2x1", "pingpong-64x256"]
WgradKernel = Literal["auto", "loop", "streams", "triton", "cutlass"]

_GEMM_KERNELS = ("auto", "torch", "cutlass")
_GEMM_CUTLASS_TILES = ("cooperative-128x256-c2x1", "pingpong-64x256")
_WGRAD_KERNELS = ("auto", "loop", "streams", "triton", "cutlass")

# The same values as ``lightning_moe.ops.fp8.recipe`` (kept here so that the config imports no torch).
Fp8Recipe = Literal["tensorwise", "rowwise", "blockwise"]
Fp8Format = Literal["e4m3", "e5m2"]
Fp8Enabled = Literal["on", "auto", "off"]
Fp8Backend = Literal["auto", "emulate", "torch", "cutlass"]
Fp8Wgrad = Literal["auto", "fp8", "activation"]

_FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
_FP8_FORMATS = ("e4m3", "e5m2")
_FP8_ENABLED = ("on", "auto", "off")
_FP8_BACKENDS = ("auto", "emulate", "torch", "cutlass")
_FP8_WGRAD = ("auto", "fp8", "activation")


def check_int(owner: str, name: str, value: Any, minimum: int = 1, *, optional: bool = False, fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= minimum`` (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = ", or None" if optional else ""
        fix = fix or f"set it to {minimum} or more"
        raise ValueError(f"{owner}: {name}={value!r} must be an int >= {minimum}{none}; {fix}.")


def check_float(
    owner: str,
    name: str,
    value: Any,
    minimum: float = 0.0,
    *,
    strict: bool = False,
    optional: bool = False,
    fix: str = "",
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number ``>= minimum`` (``> minimum`` when ``strict``).

    Ints are accepted, bools and strings are not; NaN and infinities are refused.
    """
    if optional and value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value < minimum or (strict and value == minimum):
        rule = f"{'>' if strict else '>='} {minimum:g}"
        none = ", or None" if optional else ""
        raise ValueError(
            f"{owner}: {name}={value!r} must be a finite number {rule}{none}; {fix or f'use a value {rule}'}."
        )


def check_bool(owner: str, name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} is not a bool; write {name}=True or {name}=False.")


@dataclass(kw_only=True)
class KernelConfig:
    """Which kernels the experts' GEMMs run (``MoEConfig(kernels=KernelConfig(...))``).

    Read once, when the layer is built; the defaults are the measured-fastest choice per shape. The
    optional kernels (CUTLASS: sm_90 and the CUTLASS headers; Triton: an importable ``triton``) are
    used only where they can run; elsewhere the torch path runs whatever is asked for.

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
            ``wgrad_streams_*`` streams; ``triton``: one grouped Triton launch (opt-in: no faster
            than the loop on the H200); ``cutlass``: the CUTLASS grouped kernel for every width,
            and for fresh gradients (``.grad`` is ``None``) too, with beta = 0 (opt-in: slower than
            ``F.grouped_mm`` there on the H200).
        wgrad_streams_w13: CUDA streams of the ``streams`` kernel for the up-projection ``w13``.
        wgrad_streams_w2: the same for the down-projection ``w2``.
    """

    gemm: GemmKernel = "auto"
    gemm_cutlass_tile: GemmCutlassTile = "cooperative-128x256-c2x1"
    wgrad: WgradKernel = "auto"
    wgrad_streams_w13: int = 2
    wgrad_streams_w2: int = 2

    def __post_init__(self) -> None:
        for name, allowed in (
            ("gemm", _GEMM_KERNELS),
            ("gemm_cutlass_tile", _GEMM_CUTLASS_TILES),
            ("wgrad", _WGRAD_KERNELS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"KernelConfig: {name}={value!r} is not one of {allowed}; choose one of them.")
        for name in ("wgrad_streams_w13", "wgrad_streams_w2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelConfig: {name}={value!r} must be an int >= 1; set 1 (one stream) or more.")


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
        for name, allowed in (
            ("recipe", _FP8_RECIPES),
            ("enabled", _FP8_ENABLED),
            ("backend", _FP8_BACKENDS),
            ("grad_format", _FP8_FORMATS),
            ("wgrad", _FP8_WGRAD),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Fp8Config: {name}={value!r} is not one of {allowed}; choose one of them.")
        for name in ("pow2_scales", "save_fp8_activations", "dispatch", "cache_weights"):
            check_bool("Fp8Config", name, getattr(self, name))


_BOOL_FIELDS = (
    "pre_softmax",
    "norm_topk_prob",
    "expert_bias",
    "pad_to_capacity",
    "shared_expert_gate",
    "shared_expert_overlap",
    "memory_efficient_permute",
    "fuse_wgrad_accumulation",
    "check_finite",
    "routing_weight_on_input",
    "router_bias",
    "expert_mlp_bias",
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
        if isinstance(self.kernels, dict):  # from saved hyper-parameters or a plain mapping
            self.kernels = KernelConfig(**self.kernels)
        if not isinstance(self.kernels, KernelConfig):
            raise TypeError(
                f"MoEConfig: kernels={self.kernels!r} is not a KernelConfig; "
                "pass KernelConfig(...) or a dict of its fields."
            )
        if isinstance(self.fp8, dict):  # from saved hyper-parameters or a plain mapping
            self.fp8 = Fp8Config(**self.fp8)
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(
                f"MoEConfig: fp8={self.fp8!r} is not an Fp8Config; pass Fp8Config(...), a dict of its fields, "
                "or None for bf16 experts."
            )
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # True is not a size
                raise ValueError(f"MoEConfig: {name}={value!r} must be a positive int; set it to 1 or more.")
        for name in _BOOL_FIELDS:
            check_bool("MoEConfig", name, getattr(self, name))
        self._check_numbers()
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                f"choose top_k <= {self.num_experts}."
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(f"MoEConfig: score_func={self.score_func!r} is unknown; choose one of {_SCORE_FUNCS}.")
        if self.score_func == "softmax" and self.top_k == 1 and not self.pre_softmax:
            raise ValueError(
                "MoEConfig: score_func='softmax' with top_k=1 and pre_softmax=False gives every token weight 1 "
                "and the router no gradient; set pre_softmax=True."
            )
        if self.aux_loss not in _AUX_LOSSES:
            raise ValueError(f"MoEConfig: aux_loss={self.aux_loss!r} is unknown; choose one of {_AUX_LOSSES}.")
        if self.drop_policy not in _DROP_POLICIES:
            raise ValueError(
                f"MoEConfig: drop_policy={self.drop_policy!r} is unknown; choose one of {_DROP_POLICIES}."
            )
        if self.experts_backend not in _BACKENDS:
            raise ValueError(
                f"MoEConfig: experts_backend={self.experts_backend!r} is unknown; choose one of {_BACKENDS}."
            )
        if self.router_dtype not in _ROUTER_DTYPES:
            raise ValueError(
                f"MoEConfig: router_dtype={self.router_dtype!r} is unknown; choose one of {_ROUTER_DTYPES}."
            )
        self._check_groups()
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError(
                "MoEConfig: pad_to_capacity=True needs a capacity; set capacity_factor (e.g. 1.25)."
            )
        if self.shared_expert_ffn_size is not None and (
            isinstance(self.shared_expert_ffn_size, bool)
            or not isinstance(self.shared_expert_ffn_size, int)
            or self.shared_expert_ffn_size < 1
        ):
            raise ValueError(
                f"MoEConfig: shared_expert_ffn_size={self.shared_expert_ffn_size!r} must be an int >= 1, or None for "
                "off; set a width or None."
            )
        if self.shared_expert_gate and self.shared_expert_ffn_size is None:
            raise ValueError("MoEConfig: shared_expert_gate=True needs shared_expert_ffn_size; set it or drop the gate.")
        if self.routing_weight_on_input and self.fp8 is not None:
            raise ValueError(
                "MoEConfig: routing_weight_on_input=True with fp8 experts: the FP8 rows are quantized before the "
                "weight would scale them; set fp8=None or routing_weight_on_input=False."
            )
        if self.fp8 is not None and self.fp8.enabled != "off" and not self.plain_experts:
            raise ValueError(
                f"MoEConfig: fp8 experts compute neither expert biases nor a scaled or clamped SwiGLU "
                f"(expert_mlp_bias={self.expert_mlp_bias}, swiglu_alpha={self.swiglu_alpha}, "
                f"swiglu_limit={self.swiglu_limit}, swiglu_up_offset={self.swiglu_up_offset}); set fp8=None."
            )
        if self.shared_expert_overlap and self.shared_expert_ffn_size is None:
            raise ValueError(
                "MoEConfig: shared_expert_overlap=True needs a shared expert; set shared_expert_ffn_size or drop "
                "the overlap."
            )

    def _check_numbers(self) -> None:
        """Coefficients, rates and scales: finite real numbers (NaN, inf, bools and strings refused)."""
        check_float("MoEConfig", "aux_loss_coeff", self.aux_loss_coeff, fix="use 0 or more (0 turns it off)")
        check_float(
            "MoEConfig", "z_loss_coeff", self.z_loss_coeff, optional=True, fix="use 0 or more, or None for off"
        )
        check_float("MoEConfig", "bias_update_rate", self.bias_update_rate, fix="use 0 or more, e.g. 1e-3")
        check_float("MoEConfig", "init_std", self.init_std, strict=True, fix="use e.g. 0.02")
        check_float(
            "MoEConfig", "capacity_factor", self.capacity_factor, strict=True, optional=True,
            fix="use e.g. 1.25, or None for dropless",
        )  # fmt: skip
        check_float(
            "MoEConfig", "scaling_factor", self.scaling_factor, strict=True, optional=True,
            fix="use e.g. 2.5, or None to leave the weights",
        )  # fmt: skip
        check_float("MoEConfig", "swiglu_alpha", self.swiglu_alpha, strict=True, fix="use e.g. 1.0 (silu) or 1.702")
        check_float(
            "MoEConfig", "swiglu_limit", self.swiglu_limit, strict=True, optional=True,
            fix="use e.g. 7.0, or None for no clamp",
        )  # fmt: skip
        offset = self.swiglu_up_offset
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise ValueError(f"MoEConfig: swiglu_up_offset={offset!r} must be a finite number; use e.g. 0.0 or 1.0.")

    def _check_groups(self) -> None:
        if self.num_groups is None and self.group_topk is None:
            if self.group_score_topk is not None:
                raise ValueError(
                    f"MoEConfig: group_score_topk={self.group_score_topk!r} needs group-limited routing; set "
                    "num_groups and group_topk, or leave group_score_topk=None."
                )
            return
        check_int("MoEConfig", "num_groups", self.num_groups, optional=True)
        check_int("MoEConfig", "group_topk", self.group_topk, optional=True)
        if self.num_groups is None or self.group_topk is None:
            raise ValueError(
                f"MoEConfig: num_groups={self.num_groups} and group_topk={self.group_topk} must be set together; "
                "set both or neither."
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups != 0:
            raise ValueError(
                f"MoEConfig: num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}; "
                f"choose num_groups from {_divisors(self.num_experts)}."
            )
        if not 1 <= self.group_topk <= self.num_groups:
            raise ValueError(
                f"MoEConfig: group_topk={self.group_topk} must be in [1, num_groups={self.num_groups}]; "
                "lower group_topk."
            )
        if self.group_score_topk is None and self.top_k % self.group_topk != 0:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} must be divisible by group_topk={self.group_topk} "
                "(each kept group scores with its top top_k/group_topk experts); choose group_topk from "
                f"{[d for d in _divisors(self.top_k) if d <= self.num_groups]}, or set group_score_topk."
            )
        experts_per_group = self.num_experts // self.num_groups
        if self.group_topk * experts_per_group < self.top_k:
            raise ValueError(
                f"MoEConfig: group_topk={self.group_topk} groups of {experts_per_group} experts hold fewer than "
                f"top_k={self.top_k} experts; raise group_topk."
            )
        if self.group_score_topk is None and self.top_k // self.group_topk > experts_per_group:
            raise ValueError(
                f"MoEConfig: top_k/group_topk={self.top_k // self.group_topk} exceeds the {experts_per_group} "
                "experts of one group; raise group_topk."
            )
        check_int("MoEConfig", "group_score_topk", self.group_score_topk, optional=True,
                  fix=f"use 1 to {experts_per_group}, or None for top_k // group_topk")  # fmt: skip
        if self.group_score_topk is not None and self.group_score_topk > experts_per_group:
            raise ValueError(
                f"MoEConfig: group_score_topk={self.group_score_topk} exceeds the {experts_per_group} experts of one "
                f"group; choose 1 to {experts_per_group}, or None for top_k // group_topk."
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
