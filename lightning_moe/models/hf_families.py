"""Per-family table of the Hugging Face sparse-MoE blocks :func:`swap_moe_blocks` knows or refuses.

Legend: E experts, H hidden, F expert FFN width, K experts per token, G expert groups.

One :class:`Family` entry per HF block class: where its router and shared expert live, which
routing rule it follows (``routing``, one of :data:`ROUTINGS`) and, for blocks whose math
:class:`MoELayer` cannot reproduce, the reason it is refused. Every supported block stores its
routed experts as ``experts.gate_up_proj [E, 2F, H]`` (gate rows first) and ``experts.down_proj
[E, H, F]`` (transformers 5.x; or transposed, or with gate and up interleaved, as the entry says)
or a ``ModuleList`` of per-expert MLPs (4.x); its shared expert (if any) is an ungated or
sigmoid-gated SwiGLU MLP with ``gate_proj``/``up_proj``/``down_proj``. A router bias
(``<router>.bias``) and expert biases (``experts.gate_up_proj_bias``, ``experts.down_proj_bias``)
are taken wherever the block has them (``MoEConfig.router_bias`` / ``expert_mlp_bias``).

Activations (``activation``, one of :data:`ACTIVATIONS`): ``swiglu`` is ``silu(gate) * up``;
``swiglu_clamped`` (gpt-oss) is ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``,
``u = clamp(up, -limit, limit)``, ``alpha`` and ``limit`` read from the experts (``alpha``,
``limit``) or the config (``swiglu_alpha``, ``swiglu_limit``).

Routing rules (what HF computes from the fp32 router logits ``l_TE``):

==============  ================================================================================
``softmax``     ``p = softmax(l)`` over E, top-k of ``p``, optionally renormalised (``norm``)
``softmax_k``   top-k of ``l``, softmax over the K selected logits (Granite)
``softmax_bias``  ``p = softmax(l)``; top-k of ``p + b`` (correction bias), weights from ``p``
                renormalised (ERNIE-4.5), or not and times ``routed_scaling_factor``
                (LongCat-Flash)
``softmax_scaled``  ``p = softmax(l)``, top-k of ``p`` (optionally group-limited, groups scored
                by their best expert), not renormalised, times ``routed_scaling_factor``
                (DeepSeek-V2)
``sigmoid``     ``s = sigmoid(l)``; group-limited top-k of ``s + b`` (groups scored by their
                top-2), weights from ``s`` renormalised, times ``routed_scaling_factor``
                (DeepSeek-V3); without groups or without ``b`` where the block has none
                (MiniMax-M2, AFMoE's ``route_scale``, LFM2-MoE, Cohere2-MoE's sigmoid)
``sigmoid_input``  top-k of ``l``, weight ``sigmoid(l)`` of each selected expert, applied to the
                expert's *input* (Llama 4: ``routing_weight_on_input``); not renormalised

(gpt-oss follows ``softmax_k``, its logits including the router bias.)
==============  ================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "ROUTINGS", "family_of"]

ROUTINGS = ("softmax", "softmax_k", "softmax_bias", "softmax_scaled", "sigmoid", "sigmoid_input")
ACTIVATIONS = ("swiglu", "swiglu_clamped")


@dataclass(frozen=True)
class Family:
    """How one HF block class maps onto :class:`MoELayer`.

    Attributes:
        name: family id (the transformers model type), kept on the swapped layer.
        block: HF block class name; subclasses match too.
        router: attribute path of the module holding the router weight ``[E, H]`` (``"gate"``,
            ``"router"``, ``"gate.wg"``).
        routing: one of :data:`ROUTINGS`.
        norm: renormalise the K weights: ``True``/``False``, or ``None`` to read the router's
            (or block's) ``norm_topk_prob``.
        bias: attribute path, from the block, of the selection-only correction bias
            (``gate.e_score_correction_bias``; MiniMax-M2 and AFMoE keep it on the block itself).
        shared: attribute of the ungated or gated shared-expert MLP on the block.
        shared_gate: attribute of the shared expert's ``Linear(H, 1)`` sigmoid gate.
        experts_transposed: the fused expert weights are stored ``gate_up_proj [E, H, 2F]`` and
            ``down_proj [E, F, H]`` (our layout already; Llama 4) instead of ``[E, 2F, H]`` / ``[E, H, F]``.
        gate_up_interleaved: the fused ``gate_up_proj`` (and its bias) alternates gate and up
            columns (gate ``[..., ::2]``, up ``[..., 1::2]``; gpt-oss); the swap stores them gate
            first and the export interleaves them again.
        activation: one of :data:`ACTIVATIONS`.
        routing_by: ``(attribute, ((value, routing), ...))``: the routing rule named by an HF
            attribute (Cohere2-MoE's ``expert_selection_fn``: ``softmax`` or ``sigmoid``).
        flat_output: the block returns ``(y.flatten(), router_logits.flatten())`` (ERNIE-4.5-VL's
            per-modality blocks).
        refused: why the block cannot be swapped (``None``: it can).
    """

    name: str
    block: str
    router: str = "gate"
    routing: str = "softmax"
    norm: bool | None = None
    bias: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
    experts_transposed: bool = False
    gate_up_interleaved: bool = False
    activation: str = "swiglu"
    routing_by: tuple[str, tuple[tuple[str, str], ...]] | None = None
    flat_output: bool = False
    refused: str | None = None

    def __post_init__(self) -> None:
        routings = [self.routing, *(r for _, r in (self.routing_by[1] if self.routing_by else ()))]
        for routing in routings:
            if routing not in ROUTINGS:
                raise ValueError(f"Family {self.name}: routing={routing!r} is not one of {ROUTINGS}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"Family {self.name}: activation={self.activation!r} is not one of {ACTIVATIONS}.")


_V3 = dict(routing="sigmoid", norm=None, bias="gate.e_score_correction_bias", shared="shared_experts")
_GRANITE = dict(router="router", routing="softmax_k", norm=True)

FAMILIES: dict[str, Family] = {
    f.block: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
        Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", shared="shared_expert", shared_gate="shared_expert_gate"),
        Family("mixtral", "MixtralSparseMoeBlock", norm=True),
        Family("deepseek_v3", "DeepseekV3MoE", **_V3),
        Family("glm4_moe", "Glm4MoeMoE", **_V3),
        Family("dots1", "Dots1MoE", **_V3),
        Family("olmoe", "OlmoeSparseMoeBlock"),
        Family("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", routing="softmax_bias", norm=True,
               bias="gate.moe_statics.e_score_correction_bias", shared="shared_experts"),
        Family("hunyuan_v1_moe", "HunYuanMoEV1Moe", router="gate.wg", norm=True, shared="shared_mlp"),
        Family("granitemoe", "GraniteMoeMoE", **_GRANITE),
        Family("deepseek_v2", "DeepseekV2Moe", routing="softmax_scaled", norm=False, shared="shared_experts"),
        Family("qwen3_next", "Qwen3NextSparseMoeBlock", shared="shared_expert", shared_gate="shared_expert_gate"),
        Family("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", norm=True, shared="shared_expert",
               shared_gate="shared_expert_gate"),
        Family("minimax", "MiniMaxSparseMoeBlock", norm=True),
        Family("phimoe", "PhimoeSparseMoeBlock", router="router", refused=(
            "its router is SparseMixer (a threshold-masked softmax per choice, sampled in training, with "
            "a custom gradient estimator), which MoELayer's top-k router does not compute")),
        Family("gpt_oss", "GptOssMLP", router="router", routing="softmax_k", norm=True, experts_transposed=True,
               gate_up_interleaved=True, activation="swiglu_clamped"),
        Family("llama4", "Llama4TextMoe", router="router", routing="sigmoid_input", norm=False,
               shared="shared_expert", experts_transposed=True),
        Family("minimax_m2", "MiniMaxM2SparseMoeBlock", routing="sigmoid", norm=True, bias="e_score_correction_bias"),
        Family("glm4_moe_lite", "Glm4MoeLiteMoE", **_V3),
        Family("exaone_moe", "ExaoneMoeSparseMoEBlock", **_V3),
        Family("kimi_linear", "KimiLinearMoE", **_V3),
        Family("glm4v_moe", "Glm4vMoeTextMoE", **_V3),
        Family("afmoe", "AfmoeSparseMoeBlock", router="router.gate", routing="sigmoid", norm=True, bias="expert_bias",
               shared="shared_experts"),
        Family("lfm2_moe", "Lfm2MoeSparseMoeBlock", routing="sigmoid", bias="expert_bias"),
        Family("cohere2_moe", "Cohere2MoeSparseMoeBlock", routing="softmax_k", shared="shared_experts",
               routing_by=("expert_selection_fn", (("softmax", "softmax_k"), ("sigmoid", "sigmoid")))),
        Family("longcat_flash", "LongcatFlashMoE", router="router.classifier", routing="softmax_bias", norm=False,
               bias="router.e_score_correction_bias"),
        Family("granitemoeshared", "GraniteMoeSharedMoE", **_GRANITE),
        Family("granitemoe_swa", "GraniteMoeSWAMoE", **_GRANITE),
        Family("granitemoehybrid", "GraniteMoeHybridMoE", **_GRANITE),
        Family("jamba", "JambaSparseMoeBlock", router="router", norm=False),
        Family("qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock", norm=True),
        Family("ernie4_5_vl_moe", "Ernie4_5_VLMoeSparseMoeBlock", routing="softmax_bias", norm=True,
               bias="gate.moe_statics.e_score_correction_bias", flat_output=True),
        Family("nemotron_h", "NemotronHMoE", refused=(
            "its experts are ungated MLPs (down(act(up(x))) with relu2, no gate projection) behind an optional "
            "latent projection; MoELayer's experts are gated SwiGLU (a MoEConfig option for ungated experts "
            "with a relu2 activation would be needed)")),
        Family("jetmoe", "JetMoeMoE", router="router.layer", refused=(
            "its FFN block adds one learned output bias [H] after the weighted sum of the experts, which "
            "MoELayer has no parameter for (a MoEConfig option for a layer output bias would be needed; "
            "per-expert down biases would give other gradients), and its attention experts (JetMoeMoA) are "
            "a mixture of attention heads, not an FFN MoE")),
    )
}  # fmt: skip


def family_of(module: object) -> Family | None:
    """The :class:`Family` of ``module``'s class or of its nearest base listed in :data:`FAMILIES`."""
    for cls in type(module).__mro__:
        found = FAMILIES.get(cls.__name__)
        if found is not None:
            return found
    return None
