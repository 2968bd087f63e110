"""Apply the folded layout to a model: TP on attention, EP (+ETP) on experts, FSDP2 on both.

Legend: E experts, e = E/ep local experts, H hidden, F expert FFN width, f = F/etp.

Stages of :func:`parallelize_moe_model` (collectives named with their group):

1. checks (no collective): heads divisible by tp, every ETP group inside one TP group (ETP
   ranks must hold the same tokens; not needed with ``sequence_parallel``, where every rank
   routes its own tokens), no parameter left directly on the root module;
2. TP over ``tp`` (dense mesh), by each attention / dense-MLP class's plan in
   ``parallel/tp_plans.py``: the query/key/value projections column-parallel by heads
   (``q/k/v_proj``; DeepSeek's MLA ``q_b_proj``/``kv_b_proj``), the output projection row-parallel
   (all-reduce(TP) of the output in forward, of the input gradient in backward); the same for
   dense ``gate/up/down_proj`` MLPs. Everything else stays replicated over TP; an attention class
   without a plan (or a refused one: linear attention) is an error at ``tp > 1``.
   ``sequence_parallel`` (``parallel/sequence.py``): the residual stream, the norms and the MoE
   layers hold ``S/tp`` positions; the embedding output is scattered along the sequence,
   all-gather(TP) before attention and the dense MLP, reduce-scatter(TP) after ``o_proj`` and
   ``down_proj``, all-gather before the head (a pipeline rank's ``LocalStages``, of an MoETransformer
   or an HF model: the scatter after the embedding on the first stage's rank, the gather on the
   last's; the hidden states travel between stages sharded). Norm, router and shared-expert weights are
   ``Replicate`` DTensors whose gradients are summed over TP. ``vocab_parallel``
   (``parallel/vocab.py``): the embedding rows and the head's vocabulary split over TP.
3. EP over ``ep`` (+ETP over ``etp``) on every :class:`MoELayer`: ``w13``/``w2`` are cut to this
   rank's experts and become DTensors over the expert mesh (``Shard(0)`` on ep; with ETP,
   ``w13`` column-parallel — each of the gate and up halves sharded, so the local block is
   ``[gate_j | up_j]`` — and ``w2`` row-parallel ``Shard(1)``; with ``sequence_parallel`` the
   dispatcher all-gathers the rows over ETP; expert biases, ``expert_mlp_bias``: ``b13`` like
   ``w13``'s columns, ``b2 [E, H]`` ``Shard(1)`` over ETP, each rank adding its columns only, so the
   summed partial outputs hold it once); ``layer.dispatcher`` is
   *replaced* by the ``dispatcher`` kind's (default ``"alltoall_dedup"``: a :class:`FlexDispatcher`
   over :class:`~lightning_moe.moe.dispatch.exchange_alltoall_dedup.AllToAllTokenExchange`; ``"alltoall"``: an
   :class:`AllToAllDispatcher`; or :class:`AllGatherDispatcher`, or a library exchange);
   ``layer.aux_loss_group`` becomes the ``dp_cp`` group;
4. FSDP2 ``fully_shard``: experts over ``edp`` (``Shard(1)``, the H dim, so a rank with few
   experts is never padded), then every block of a ``ModuleList`` and every child of the root
   over ``dp_cp``. The experts' reduce-scatter output is multiplied by
   ``edp*etp / (tp*cp*dp)`` (``grad.expert_grad_scale``; ``edp / (cp*dp)`` with
   ``sequence_parallel``, where each token reaches the experts once) so expert and dense
   gradients both end as the data-parallel average. ``GroupedExperts.forward_local`` (the fused local path at EP=1)
   is registered as an FSDP forward method, so the EDP all-gather runs around it as well.

The ETP layout of ``w13`` in the DTensor is "blocked": global column block j holds
``[gate_j | up_j]``; :func:`unblock_w13` converts a full tensor back to ``[gate | up]``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_moe.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.flex import FlexDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.grad import expert_grad_scale, install_expert_grad_scaling
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.pipeline_stage import LocalStages, TransformerStage
from lightning_moe.parallel.sequence import gather_from_sequence, scatter_to_sequence, sum_grads_over_tp
from lightning_moe.parallel.tp_apply import apply_attention_plan, apply_mlp_plan, check_tp_plans, tp_targets
from lightning_moe.parallel.tp_plans import AttentionPlan, MLPPlan, sequence_parallel_refusal
from lightning_moe.parallel.vocab import VocabParallelEmbedding, mark_vocab_parallel_head

__all__ = [
    "DISPATCHERS",
    "DispatcherKind",
    "applied_expert_grad_scale",
    "check_dispatcher",
    "check_model_for_layout",
    "check_sequence_parallel_attention",
    "init_experts_by_id",
    "parallelize_moe_model",
    "shard_expert_biases",
    "shard_expert_weights",
    "unblock_w13",
]

DispatcherKind = Literal["alltoall", "alltoall_dedup", "allgather", "deepep", "hybridep"]
DISPATCHERS: tuple[str, ...] = get_args(DispatcherKind)


def check_dispatcher(dispatcher: str, owner: str = "parallelize_moe_model") -> None:
    """An unknown token-exchange name is an error naming the choices (never a silent default)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"{owner}: dispatcher={dispatcher!r} is unknown; choose one of {DISPATCHERS}.")


def shard_expert_weights(
    w13: torch.Tensor, w2: torch.Tensor, *, ep_rank: int, ep: int, etp_rank: int, etp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local ``w13 [e, H, 2f]`` (``[gate_j | up_j]``) and ``w2 [e, f, H]`` of full weights."""
    E, H, two_F = w13.shape
    e, F = E // ep, two_F // 2
    f = F // etp
    w13_e = w13[ep_rank * e : (ep_rank + 1) * e]
    cols = slice(etp_rank * f, (etp_rank + 1) * f)
    w13_local = torch.cat([w13_e[..., :F][..., cols], w13_e[..., F:][..., cols]], dim=-1).contiguous()
    w2_local = w2[ep_rank * e : (ep_rank + 1) * e, cols].contiguous()
    return w13_local, w2_local


def shard_expert_biases(
    b13: torch.Tensor, b2: torch.Tensor, *, ep_rank: int, ep: int, etp_rank: int, etp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local ``b13 [e, 2f]`` (``[gate_j | up_j]``, as ``w13``'s columns) and ``b2 [e, H/etp]``
    (columns ``etp_rank*H/etp:``) of full biases."""
    E, two_F = b13.shape
    H = b2.shape[-1]
    if H % etp:
        raise ValueError(
            f"shard_expert_biases: hidden size {H} is not divisible by etp={etp} (the down bias is split over its "
            "columns); choose an etp that divides the hidden size."
        )
    e, F = E // ep, two_F // 2
    f, h = F // etp, H // etp
    b13_e = b13[ep_rank * e : (ep_rank + 1) * e]
    cols = slice(etp_rank * f, (etp_rank + 1) * f)
    b13_local = torch.cat([b13_e[..., :F][..., cols], b13_e[..., F:][..., cols]], dim=-1).contiguous()
    b2_local = b2[ep_rank * e : (ep_rank + 1) * e, etp_rank * h : (etp_rank + 1) * h].contiguous()
    return b13_local, b2_local


def unblock_w13(w13_blocked: torch.Tensor, etp: int) -> torch.Tensor:
    """Blocked ``[gate_0|up_0|gate_1|up_1|...]`` columns back to ``[gate | up]``."""
    if etp == 1:
        return w13_blocked
    *lead, two_F = w13_blocked.shape
    f = two_F // (2 * etp)
    blocks = w13_blocked.reshape(*lead, etp, 2, f)
    return torch.cat([blocks[..., 0, :].reshape(*lead, etp * f), blocks[..., 1, :].reshape(*lead, etp * f)], -1)


def _transformer_parts(module: nn.Module) -> nn.Module | None:
    """The module under ``module`` shaped like :class:`~lightning_moe.models.transformer.MoETransformer`
    (``embed``, ``layers`` of blocks with ``attn_norm``/``attn``/``ffn_norm``/``ffn``, ``norm``,
    ``lm_head``), or a pipeline rank's :class:`LocalStages` of one (its blocks in a ``ModuleDict``;
    ``embed`` only on the first stage's rank, ``norm`` and ``lm_head`` on the last's), or ``None``."""
    block_parts = ("attn_norm", "attn", "ffn_norm", "ffn")
    for m in module.modules():
        layers = getattr(m, "layers", None)
        if isinstance(m, LocalStages) and isinstance(layers, nn.ModuleDict):
            if all(all(isinstance(getattr(b, n, None), nn.Module) for n in block_parts) for b in layers.values()):
                return m
            continue
        if (
            isinstance(getattr(m, "embed", None), nn.Embedding)
            and isinstance(getattr(m, "lm_head", None), nn.Linear)
            and isinstance(getattr(m, "norm", None), nn.Module)
            and isinstance(layers, nn.ModuleList)
            and all(all(isinstance(getattr(b, n, None), nn.Module) for n in block_parts) for b in layers)
        ):
            return m
    return None


def _check_sequence_vocab(
    module: nn.Module, layout: FoldedLayout, sequence_parallel: bool, vocab_parallel: bool
) -> None:
    for name, value in (("sequence_parallel", sequence_parallel), ("vocab_parallel", vocab_parallel)):
        if not isinstance(value, bool):
            raise TypeError(f"parallelize_moe_model: {name}={value!r} must be a bool; pass True or False.")
        if value and layout.tp == 1:
            raise ValueError(f"parallelize_moe_model: {name}=True needs tp > 1 (tp=1); set tp >= 2 or {name}=False.")
    if not (sequence_parallel or vocab_parallel):
        return
    root = _transformer_parts(module)
    hf = _hf_decoder_parts(module) is not None or _hf_stages(module) is not None
    if root is None and not (sequence_parallel and not vocab_parallel and hf):
        raise ValueError(
            f"parallelize_moe_model: sequence_parallel needs an MoETransformer-shaped model (embed, layers of blocks "
            "with attn_norm/attn/ffn_norm/ffn, norm, lm_head) or a Hugging Face causal LM (model.embed_tokens, "
            "model.layers, model.norm, lm_head), and vocab_parallel an MoETransformer-shaped one; "
            f"{type(module).__name__} has neither. Turn "
            f"{'vocab_parallel' if vocab_parallel else 'sequence_parallel'} off for this model."
        )
    if sequence_parallel:
        for m in module.modules():
            if isinstance(m, MoELayer) and m.config.aux_loss in ("seq", "global"):
                raise ValueError(
                    f"parallelize_moe_model: sequence_parallel=True with aux_loss={m.config.aux_loss!r} "
                    f"({m.layer_name}) is not supported (its counts would cover one sequence shard); use "
                    "aux_loss='switch' or 'none', or sequence_parallel=False."
                )
    if vocab_parallel and root is not None:
        V = root.embed.weight.shape[0]
        if root.lm_head.weight is root.embed.weight:
            raise ValueError(
                "parallelize_moe_model: vocab_parallel=True with tied embeddings (lm_head.weight is embed.weight) is "
                "not supported; set tie_embeddings=False or vocab_parallel=False."
            )
        if V % layout.tp or root.lm_head.out_features % layout.tp:
            raise ValueError(
                f"parallelize_moe_model: vocab_parallel=True needs vocab_size={V} divisible by tp={layout.tp}; pad "
                f"the vocabulary to {-(-V // layout.tp) * layout.tp} or set vocab_parallel=False."
            )


def check_model_for_layout(
    module: nn.Module, layout: FoldedLayout, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> None:
    """Rules that need both the model and the layout; raises ``ValueError`` (no collective)."""
    _check_sequence_vocab(module, layout, sequence_parallel, vocab_parallel)
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layout.check_experts(layer.config.num_experts, layer.config.ffn_hidden_size)
        if layer.config.pad_to_capacity and layout.ep > 1:
            raise ValueError(
                f"FoldedMoEStrategy: pad_to_capacity=True with ep={layout.ep} is not supported yet; "
                "set pad_to_capacity=False or ep=1."
            )
    if layout.tp > 1:
        check_tp_plans(module, layout.tp)
        if sequence_parallel:
            check_sequence_parallel_attention(module)
    if layout.etp > 1 and not sequence_parallel:  # with it, every rank routes its own tokens
        for group in layout.groups("etp"):
            if not set(group) <= set(layout.group_of("tp", group[0])):
                raise ValueError(
                    f"FoldedMoEStrategy: etp={layout.etp} with tp={layout.tp} and order={layout.order!r} puts ETP group "
                    f"{group} outside one TP group; expert tensor parallel ranks must be tensor-parallel replicas: "
                    "choose etp dividing tp and keep tp first in order."
                )
    if layers and any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"FoldedMoEStrategy: {type(module).__name__} holds parameters directly; FSDP would leave them "
            "unreduced. Move them into a submodule."
        )


def check_sequence_parallel_attention(module: nn.Module, owner: str = "FoldedMoEStrategy") -> None:
    """``ValueError`` naming the first attention module under ``module`` whose class sequence parallel
    cannot take (``tp_plans.sequence_parallel_refusal``: e.g. multi-head latent attention)."""
    for name, m, plan in tp_targets(module):
        reason = sequence_parallel_refusal(plan) if isinstance(plan, AttentionPlan) else None
        if reason is not None:
            raise ValueError(
                f"{owner}: sequence_parallel=True is not supported with {name} ({type(m).__name__}): {reason}. "
                "Set sequence_parallel=False for this model."
            )


def _apply_tp(module: nn.Module, mesh: FoldedMesh, *, sequence_parallel: bool = False, vocab_parallel: bool = False) -> None:
    tp_mesh = mesh.mesh("tp")
    # with sequence parallel the row-parallel outputs are reduce-scattered along the sequence
    row = (lambda: RowwiseParallel(output_layouts=Shard(1))) if sequence_parallel else RowwiseParallel
    # each attention / dense-MLP class's own projection names and extra collectives: parallel/tp_plans.py
    for _, m, plan in tp_targets(module):
        if isinstance(plan, AttentionPlan):
            apply_attention_plan(m, plan, tp_mesh, row)
        elif isinstance(plan, MLPPlan):
            apply_mlp_plan(m, plan, tp_mesh, row)
        else:
            continue
        if sequence_parallel:  # one all-gather(TP) of the input for all the column-parallel projections
            m.register_forward_pre_hook(functools.partial(_gather_first_input, tp_mesh), with_kwargs=True)
    if sequence_parallel or vocab_parallel:
        root = _transformer_parts(module)
        if root is not None:
            _apply_sequence_and_vocab(root, mesh, sequence_parallel, vocab_parallel)
            return
        stages = _hf_stages(module)
        if stages is not None:
            _apply_hf_stages_sequence(stages, mesh)
            return
        hf_parts = _hf_decoder_parts(module)
        assert hf_parts is not None  # checked by check_model_for_layout
        _apply_hf_sequence(*hf_parts, mesh)


def _gather_first_input(tp_mesh: Any, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``[B, s, H]`` local -> a ``Replicate`` DTensor ``[B, S, H]``: all-gather(TP) in forward; the
    projections' partial input gradients are summed and reduce-scattered(TP) in backward. The input is
    the first positional argument, or ``hidden_states=`` (how HF decoder layers call attention)."""
    def gather(x_BsH: torch.Tensor) -> DTensor:
        return DTensor.from_local(x_BsH, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()])

    if args:
        return (gather(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}


def _hf_decoder_parts(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(decoder, lm_head)`` of a Hugging Face causal LM under ``module`` (the decoder holding
    ``embed_tokens``, ``layers`` and ``norm``; the head its sibling), or ``None``."""
    for m in module.modules():
        lm_head = getattr(m, "lm_head", None)
        if not isinstance(lm_head, nn.Linear):
            continue
        for d in m.children():
            if (
                isinstance(getattr(d, "embed_tokens", None), nn.Embedding)
                and isinstance(getattr(d, "layers", None), nn.ModuleList)
                and isinstance(getattr(d, "norm", None), nn.Module)
            ):
                return d, lm_head
    return None


def _hf_stages(module: nn.Module) -> LocalStages | None:
    """A pipeline rank's stages of a Hugging Face causal LM under ``module`` (a :class:`LocalStages`
    whose blocks are not MoETransformer blocks), or ``None``."""
    if _transformer_parts(module) is not None:
        return None
    return next((m for m in module.modules() if isinstance(m, LocalStages)), None)


def _scatter_first_input(group: Any, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    if args:
        return (scatter_to_sequence(args[0], group), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": scatter_to_sequence(kwargs["hidden_states"], group)}


def _apply_hf_sequence(decoder: nn.Module, lm_head: nn.Module, mesh: FoldedMesh) -> None:
    """Sequence parallel for an HF causal LM: the embedding, the rotary tables and the mask are made for
    the whole sequence as usual; the first decoder layer's input is scattered along the sequence over
    TP and the head's input all-gathered, so the residual stream between them, the norms and the MoE
    layers hold ``S/tp`` positions. Modules of a decoder layer outside the TP-cut attention and MLPs
    (the norms; an MoE layer's router and shared expert) get their gradients summed over TP."""
    tp_group = mesh.group("tp")
    decoder.layers[0].register_forward_pre_hook(functools.partial(_scatter_first_input, tp_group), with_kwargs=True)
    lm_head.register_forward_pre_hook(functools.partial(_gather_input, tp_group))
    _sum_hf_sequence_grads(decoder, decoder.norm, list(decoder.layers), mesh)


def _apply_hf_stages_sequence(stages: LocalStages, mesh: FoldedMesh) -> None:
    """Sequence parallel for a pipeline rank's HF stages: the first stage's embedding output is
    scattered along the sequence over TP (each stage builds its rotary tables and mask for the whole
    sequence from the ids it is given) and the last stage's head input all-gathered; the gradients
    summed over TP as for the whole model (:func:`_apply_hf_sequence`)."""
    tp_group = mesh.group("tp")
    if stages.embed is not None:
        stages.embed.register_forward_hook(functools.partial(_scatter_output, tp_group))
    if stages.lm_head is not None:
        stages.lm_head.register_forward_pre_hook(functools.partial(_gather_input, tp_group))
    _sum_hf_sequence_grads(stages, stages.norm, list(stages.layers.values()), mesh)


def _sum_hf_sequence_grads(
    module: nn.Module, norm: nn.Module | None, blocks: list[nn.Module], mesh: FoldedMesh
) -> None:
    """The final ``norm`` and each decoder layer's modules outside the TP-cut attention and MLPs of
    ``module`` get their gradients summed over TP (:func:`_sum_sequence_grads`)."""
    tp_mesh = mesh.mesh("tp")
    sequence_group = mesh.group("tp_cp") if mesh.size("cp") > 1 else mesh.group("tp")
    if norm is not None:
        sum_grads_over_tp(norm, tp_mesh)
    cut = {id(m) for _, m, _ in tp_targets(module)}
    for block in blocks:
        _sum_sequence_grads(block, cut, tp_mesh, sequence_group)


def _sum_sequence_grads(module: nn.Module, cut: set[int], tp_mesh: Any, sequence_group: Any) -> None:
    """Below ``module``: every child outside the TP-cut modules (``cut``) and the experts sees this
    rank's positions only, so its gradients are summed over TP; MoE layers count their switch
    aux loss over ``sequence_group``."""
    for child in module.children():
        if id(child) in cut:
            continue
        if isinstance(child, MoELayer):
            for part in child.children():
                if part is not child.experts:
                    sum_grads_over_tp(part, tp_mesh)  # router, shared expert: they see this rank's tokens
            child.aux_loss_sequence_group = sequence_group
            child.aux_loss_shards = tp_mesh.size()
        elif any(id(m) in cut or isinstance(m, MoELayer) for m in child.modules()):
            _sum_sequence_grads(child, cut, tp_mesh, sequence_group)
        else:
            sum_grads_over_tp(child, tp_mesh)  # the norms: they see this rank's positions


def _scatter_output(group: Any, module: nn.Module, args: tuple, out_BSH: torch.Tensor) -> torch.Tensor:
    return scatter_to_sequence(out_BSH, group)


def _gather_input(group: Any, module: nn.Module, args: tuple) -> tuple:
    return (gather_from_sequence(args[0], group), *args[1:])


def _apply_sequence_and_vocab(root: nn.Module, mesh: FoldedMesh, sequence_parallel: bool, vocab_parallel: bool) -> None:
    """The embedding, the head, the norms and the MoE layers of an MoETransformer-shaped ``root``."""
    tp_mesh, tp_group, tp = mesh.mesh("tp"), mesh.group("tp"), mesh.size("tp")
    # the ranks holding the other positions of this rank's sequences: TP (and CP) ranks
    sequence_group = mesh.group("tp_cp") if mesh.size("cp") > 1 else tp_group
    if vocab_parallel and root is not None:
        V = root.embed.weight.shape[0]
        root.embed = VocabParallelEmbedding(root.embed, tp_mesh, sequence_parallel=sequence_parallel)
        head = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(), use_local_output=True)
        parallelize_module(root.lm_head, tp_mesh, head)
        mark_vocab_parallel_head(root.lm_head, tp_group, mesh.rank("tp") * (V // tp))
    elif sequence_parallel:  # a pipeline rank's stages may hold neither (the hidden travels sharded)
        if root.embed is not None:
            root.embed.register_forward_hook(functools.partial(_scatter_output, tp_group))
        if root.lm_head is not None:
            root.lm_head.register_forward_pre_hook(functools.partial(_gather_input, tp_group))
    if not sequence_parallel:
        return
    if root.norm is not None:
        sum_grads_over_tp(root.norm, tp_mesh)
    for block in root.layers.values() if isinstance(root.layers, nn.ModuleDict) else root.layers:
        sum_grads_over_tp(block.attn_norm, tp_mesh)
        sum_grads_over_tp(block.ffn_norm, tp_mesh)
        if isinstance(block.ffn, MoELayer):
            layer = block.ffn
            for child in layer.children():
                if child is not layer.experts:
                    sum_grads_over_tp(child, tp_mesh)  # router, shared expert: they see this rank's tokens
            # switch counts over the whole sequences; the TP ranks' aux gradients add up (CP ranks'
            # are averaged by FSDP), so each TP rank's loss counts 1/tp
            layer.aux_loss_sequence_group = sequence_group
            layer.aux_loss_shards = tp


def _shard_experts(experts: GroupedExperts, mesh: FoldedMesh) -> None:
    lay = mesh.layout
    shard_mesh = mesh.expert_shard_mesh
    ep_rank, etp_rank = mesh.rank("ep"), mesh.rank("etp")
    w13, w2 = shard_expert_weights(
        experts.w13.detach(), experts.w2.detach(), ep_rank=ep_rank, ep=lay.ep, etp_rank=etp_rank, etp=lay.etp
    )
    place13 = [Shard(0)] if lay.etp == 1 else [Shard(0), Shard(2)]
    place2 = [Shard(0)] if lay.etp == 1 else [Shard(0), Shard(1)]
    shards = [("w13", w13, place13), ("w2", w2, place2)]
    if experts.b13 is not None and experts.b2 is not None:
        b13, b2 = shard_expert_biases(
            experts.b13.detach(), experts.b2.detach(), ep_rank=ep_rank, ep=lay.ep, etp_rank=etp_rank, etp=lay.etp
        )
        place_b = [Shard(0)] if lay.etp == 1 else [Shard(0), Shard(1)]
        shards += [("b13", b13, place_b), ("b2", b2, place_b)]
        experts.down_bias_offset = etp_rank * b2.shape[-1]
    for name, local, placements in shards:
        full = getattr(experts, name)
        dt = DTensor.from_local(
            local, shard_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
    experts.etp = lay.etp  # read by checkpoint/gather code to undo the blocked w13 layout


def init_experts_by_id(module: nn.Module, mesh: FoldedMesh, seed: int) -> None:
    """Re-initialise local experts so expert g of layer l is drawn from ``seed + 7919*l + g``.

    For meta-device (empty) init: every EP rank gets different experts, and the values do not
    depend on the layout (the same as one process drawing each expert from its own seed).
    Experts marked ``seeded_or_loaded`` (seeded here once already, or loaded from a checkpoint:
    a strategy set up again for ``validate`` after ``fit``, a pretrained model) keep their weights;
    the others are marked once drawn.
    Call it on a module :func:`parallelize_moe_model` has sharded: each layer's ``num_experts`` is
    the global count there, and this rank's experts are ``num_experts // ep`` of them.
    """
    lay = mesh.layout
    for ordinal, (_, layer) in enumerate((n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)):
        index = getattr(layer, "global_moe_index", ordinal)  # a pipeline stage's layers keep the model's count
        ex = layer.experts
        if getattr(ex, "seeded_or_loaded", False):
            continue
        e = ex.num_experts // lay.ep
        w13_parts, w2_parts = [], []
        for g in range(mesh.rank("ep") * e, (mesh.rank("ep") + 1) * e):
            gen = torch.Generator().manual_seed(seed + 7919 * index + g)
            w13_g = torch.randn(1, ex.hidden_size, 2 * ex.ffn_hidden_size, generator=gen) * ex.init_std
            w2_g = torch.randn(1, ex.ffn_hidden_size, ex.hidden_size, generator=gen) * ex.init_std
            a, b = shard_expert_weights(w13_g, w2_g, ep_rank=0, ep=1, etp_rank=mesh.rank("etp"), etp=lay.etp)
            w13_parts.append(a)
            w2_parts.append(b)
        for name, parts in (("w13", w13_parts), ("w2", w2_parts)):
            param = getattr(ex, name)
            local = torch.cat(parts)
            with torch.no_grad():
                target = param.to_local() if isinstance(param, DTensor) else param
                # FSDP shards the local experts once more over edp along H (dim 1)
                if target.shape != local.shape:
                    edp, edp_rank = mesh.size("edp"), mesh.rank("edp")
                    local = local.chunk(edp, dim=1)[edp_rank]
                target.copy_(local.to(target.dtype))
        ex.seeded_or_loaded = True


def parallelize_moe_model(
    module: nn.Module,
    *,
    mesh: FoldedMesh,
    dispatcher: DispatcherKind = "alltoall_dedup",
    fsdp: bool = True,
    reshard_after_forward: bool = True,
    shard_root: bool = False,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
) -> nn.Module:
    """Shard ``module`` in place for ``mesh`` (stages in the module docstring); returns it.

    ``shard_root``: also ``fully_shard`` the root (a plain ``nn.Module``, as Fabric passes);
    otherwise each child of the root is sharded (a LightningModule stays an ordinary module).
    ``fsdp=False`` stops after stage 3 (tests of the dispatch alone).
    ``sequence_parallel``: shard the residual stream, the norms and the MoE layers' tokens along
    the sequence over TP (sequences must be a multiple of ``tp`` long). ``vocab_parallel``: split
    the embedding rows and the head's vocabulary over TP; the head's logits are then this rank's
    vocabulary slice, for ``parallel.vocab.lm_cross_entropy``. Both need ``tp > 1`` and an
    MoETransformer-shaped model.
    """
    lay = mesh.layout
    check_model_for_layout(module, lay, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    check_dispatcher(dispatcher)
    if sequence_parallel and lay.etp > 1 and dispatcher == "allgather":
        raise ValueError(
            f"parallelize_moe_model: dispatcher='allgather' with etp={lay.etp} and sequence_parallel=True is not "
            "supported; use dispatcher='alltoall' or 'alltoall_dedup'."
        )
    if lay.tp > 1:
        _apply_tp(module, mesh, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    _install_dispatchers(layers, mesh, dispatcher, sequence_parallel)
    if not fsdp or lay.world_size == 1:
        # One rank: FSDP2 would shard nothing and only copy (every parameter all-gathered into a
        # second buffer, every gradient packed for a reduce-scatter of one), so the model stays plain.
        return module
    _shard_experts_fsdp(layers, mesh, applied_expert_grad_scale(lay, sequence_parallel), reshard_after_forward)
    _shard_dense_fsdp(module, mesh.mesh("dp_cp"), shard_root, reshard_after_forward)
    return module


def _install_dispatchers(layers: list[MoELayer], mesh: FoldedMesh, dispatcher: str, sequence_parallel: bool) -> None:
    """Each MoE layer's aux-loss group, and with experts over EP/ETP ranks its sharded experts and
    its token exchange (one library buffer per expert count, shared by the layers)."""
    lay = mesh.layout
    dp_cp_group = mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None
    exchanges: dict[int, Any] = {}
    for layer in layers:
        layer.aux_loss_group = dp_cp_group
        if lay.ep == 1 and lay.etp == 1:
            continue
        _shard_experts(layer.experts, mesh)
        groups = dict(ep_group=mesh.group("ep"), etp_group=mesh.group("etp"))
        num_experts = layer.config.num_experts
        etp_sp = dict(etp_sequence_parallel=True) if sequence_parallel and lay.etp > 1 else {}
        if dispatcher in ("alltoall_dedup", "deepep", "hybridep"):
            if num_experts not in exchanges:
                exchanges[num_experts] = _flex_exchange(dispatcher, mesh.group("ep"), num_experts)
            layer.dispatcher = FlexDispatcher(num_experts, **groups, exchange=exchanges[num_experts], **etp_sp)
        elif dispatcher == "alltoall":
            layer.dispatcher = AllToAllDispatcher(num_experts, **groups, **etp_sp)
        else:
            layer.dispatcher = AllGatherDispatcher(num_experts, **groups)


def _shard_experts_fsdp(
    layers: list[MoELayer], mesh: FoldedMesh, grad_scale: float, reshard_after_forward: bool
) -> None:
    """FSDP2 over EDP for each layer's experts (sharded along H), their gradients scaled by ``grad_scale``."""
    for layer in layers:
        fully_shard(
            layer.experts,
            mesh=mesh.mesh("edp"),
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=lambda p: Shard(1),
        )
        install_expert_grad_scaling(layer.experts, grad_scale)  # type: ignore[arg-type]
        # The local (EP=1) path calls ``experts.forward_local`` instead of ``experts(...)``: FSDP
        # must all-gather the EDP shards around that method too, not only around ``forward``.
        if hasattr(layer.experts, "forward_local"):
            register_fsdp_forward_method(layer.experts, "forward_local")


def _shard_dense_fsdp(module: nn.Module, dense_mesh: Any, shard_root: bool, reshard_after_forward: bool) -> None:
    """FSDP2 over DP×CP for every block of a ``ModuleList`` and then the root (``shard_root``) or
    each of its children, wherever parameters are not managed yet.

    A pipeline stage (``TransformerStage``, ``LocalStages``) first has each block of its
    ``ModuleDict`` and each of its other children (embedding, norm, head) sharded on its own: the
    schedule calls them from stage views, never through the module that holds them, so no FSDP
    hook may sit on that module (nor on a root that is one)."""
    stages = [m for m in module.modules() if isinstance(m, (TransformerStage, LocalStages))]
    for stage in stages:
        for child in [*stage.layers.values(), *stage.children()]:
            if _has_unmanaged_params(child):
                fully_shard(child, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
    for m in list(module.modules()):
        if isinstance(m, nn.ModuleList):
            for block in m:
                if _has_unmanaged_params(block):
                    fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
    if shard_root and not stages:
        fully_shard(module, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
        return
    for child in module.children():
        if _has_unmanaged_params(child):
            fully_shard(child, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)


def applied_expert_grad_scale(layout: FoldedLayout, sequence_parallel: bool = False) -> float:
    """The factor :func:`parallelize_moe_model` applies to expert gradients: ``grad.expert_grad_scale``,
    times ``tp/etp`` with sequence parallel (each token then reaches the experts once, not
    ``tp/etp`` times): ``edp / (cp*dp)``."""
    scale = expert_grad_scale(layout)
    return scale * layout.tp / layout.etp if sequence_parallel else scale


def _flex_exchange(dispatcher: str, ep_group: Any, num_experts: int) -> Any:
    """The library adapter behind ``dispatcher`` (its optional package is imported here)."""
    if dispatcher == "alltoall_dedup":
        from lightning_moe.moe.dispatch.exchange_alltoall_dedup import AllToAllTokenExchange

        return AllToAllTokenExchange(ep_group)
    if dispatcher == "deepep":
        from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange, make_deep_ep_buffer

        return DeepEPExchange(make_deep_ep_buffer(ep_group))
    from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange

    return HybridEPExchange(ep_group, num_experts)


def _has_unmanaged_params(module: nn.Module) -> bool:
    """True if ``module`` holds a parameter that no FSDP module at or below it manages."""
    if isinstance(module, FSDPModule):
        return False
    if any(True for _ in module.parameters(recurse=False)):
        return True
    return any(_has_unmanaged_params(child) for child in module.children())
