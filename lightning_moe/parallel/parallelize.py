"""Apply the folded layout to a model: TP on attention, EP (+ETP) on experts, FSDP2 on both.

Legend: E experts, e = E/ep local experts, H hidden, F expert FFN width, f = F/etp.

Stages of :func:`parallelize_moe_model` (collectives named with their group):

1. checks (no collective): heads divisible by tp, every ETP group inside one TP group (ETP
   ranks must hold the same tokens), no parameter left directly on the root module;
2. TP over ``tp`` (dense mesh): ``q/k/v_proj`` column-parallel, ``o_proj`` row-parallel
   (all-reduce(TP) of the output in forward, of the input gradient in backward); the same for
   dense ``gate/up/down_proj`` MLPs. Everything else stays replicated over TP;
3. EP over ``ep`` (+ETP over ``etp``) on every :class:`MoELayer`: ``w13``/``w2`` are cut to this
   rank's experts and become DTensors over the expert mesh (``Shard(0)`` on ep; with ETP,
   ``w13`` column-parallel — each of the gate and up halves sharded, so the local block is
   ``[gate_j | up_j]`` — and ``w2`` row-parallel ``Shard(1)``); ``layer.dispatcher`` is
   *replaced* by the ``dispatcher`` kind's (default ``"alltoall_dedup"``: a :class:`FlexDispatcher`
   over :class:`~lightning_moe.moe.dispatch.exchange_alltoall_dedup.AllToAllTokenExchange`; ``"alltoall"``: an
   :class:`AllToAllDispatcher`; or :class:`AllGatherDispatcher`, or a library exchange);
   ``layer.aux_loss_group`` becomes the ``dp_cp`` group;
4. FSDP2 ``fully_shard``: experts over ``edp`` (``Shard(1)``, the H dim, so a rank with few
   experts is never padded), then every block of a ``ModuleList`` and every child of the root
   over ``dp_cp``. The experts' reduce-scatter output is multiplied by
   ``edp*etp / (tp*cp*dp)`` (``grad.expert_grad_scale``) so expert and dense gradients both end
   as the data-parallel average. ``GroupedExperts.forward_local`` (the fused local path at EP=1)
   is registered as an FSDP forward method, so the EDP all-gather runs around it as well.

The ETP layout of ``w13`` in the DTensor is "blocked": global column block j holds
``[gate_j | up_j]``; :func:`unblock_w13` converts a full tensor back to ``[gate | up]``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lightning_moe.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.flex import FlexDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.grad import expert_grad_scale, install_expert_grad_scaling
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh

__all__ = [
    "DISPATCHERS",
    "DispatcherKind",
    "check_dispatcher",
    "check_model_for_layout",
    "init_experts_by_id",
    "parallelize_moe_model",
    "shard_expert_weights",
    "unblock_w13",
]

DispatcherKind = Literal["alltoall", "alltoall_dedup", "allgather", "deepep", "hybridep"]
DISPATCHERS: tuple[str, ...] = ("alltoall", "alltoall_dedup", "allgather", "deepep", "hybridep")


def check_dispatcher(dispatcher: str, owner: str = "parallelize_moe_model") -> None:
    """An unknown token-exchange name is an error naming the choices (never a silent default)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"{owner}: dispatcher={dispatcher!r} is unknown; choose one of {DISPATCHERS}.")


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


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


def unblock_w13(w13_blocked: torch.Tensor, etp: int) -> torch.Tensor:
    """Blocked ``[gate_0|up_0|gate_1|up_1|...]`` columns back to ``[gate | up]``."""
    if etp == 1:
        return w13_blocked
    *lead, two_F = w13_blocked.shape
    f = two_F // (2 * etp)
    blocks = w13_blocked.reshape(*lead, etp, 2, f)
    return torch.cat([blocks[..., 0, :].reshape(*lead, etp * f), blocks[..., 1, :].reshape(*lead, etp * f)], -1)


def check_model_for_layout(module: nn.Module, layout: FoldedLayout) -> None:
    """Rules that need both the model and the layout; raises ``ValueError`` (no collective)."""
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layout.check_experts(layer.config.num_experts, layer.config.ffn_hidden_size)
        if layer.config.pad_to_capacity and layout.ep > 1:
            raise ValueError(
                f"FoldedMoEStrategy: pad_to_capacity=True with ep={layout.ep} is not supported yet; "
                "set pad_to_capacity=False or ep=1."
            )
    if layout.tp > 1:
        for name, m in module.named_modules():
            if _has_linears(m, _ATTN):
                heads = m.q_proj.out_features // getattr(m, "head_dim", 1)
                kv = m.k_proj.out_features // getattr(m, "head_dim", 1)
                if heads % layout.tp or kv % layout.tp:
                    raise ValueError(
                        f"FoldedMoEStrategy: tp={layout.tp} must divide the {heads} query and {kv} key/value heads "
                        f"of {name or 'the model'}; choose tp dividing {kv}."
                    )
    if layout.etp > 1:
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


def _apply_tp(module: nn.Module, mesh: FoldedMesh) -> None:
    tp_mesh = mesh.mesh("tp")
    for m in list(module.modules()):
        if _has_linears(m, _ATTN):
            plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()}
            # Per-head q/k norms (Qwen3) see only this rank's heads ([B, S, heads, D], heads on
            # dim 2): their one weight is a TP-replicated DTensor, so its partial gradients are
            # summed over TP instead of drifting apart rank by rank.
            for norm in ("q_norm", "k_norm"):
                if isinstance(getattr(m, norm, None), nn.Module):
                    plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
            parallelize_module(m, tp_mesh, plan | {"o_proj": RowwiseParallel()})
        elif _has_linears(m, _MLP):
            plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            parallelize_module(m, tp_mesh, plan)


def _shard_experts(experts: GroupedExperts, mesh: FoldedMesh) -> None:
    lay = mesh.layout
    shard_mesh = mesh.expert_shard_mesh
    ep_rank, etp_rank = mesh.rank("ep"), mesh.rank("etp")
    w13, w2 = shard_expert_weights(
        experts.w13.detach(), experts.w2.detach(), ep_rank=ep_rank, ep=lay.ep, etp_rank=etp_rank, etp=lay.etp
    )
    place13 = [Shard(0)] if lay.etp == 1 else [Shard(0), Shard(2)]
    place2 = [Shard(0)] if lay.etp == 1 else [Shard(0), Shard(1)]
    for name, local, placements in (("w13", w13, place13), ("w2", w2, place2)):
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
    Call it on a module :func:`parallelize_moe_model` has sharded: each layer's ``num_experts`` is
    the global count there, and this rank's experts are ``num_experts // ep`` of them.
    """
    lay = mesh.layout
    for index, (_, layer) in enumerate((n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)):
        ex = layer.experts
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


def parallelize_moe_model(
    module: nn.Module,
    *,
    mesh: FoldedMesh,
    dispatcher: DispatcherKind = "alltoall_dedup",
    fsdp: bool = True,
    reshard_after_forward: bool = True,
    shard_root: bool = False,
) -> nn.Module:
    """Shard ``module`` in place for ``mesh`` (stages in the module docstring); returns it.

    ``shard_root``: also ``fully_shard`` the root (a plain ``nn.Module``, as Fabric passes);
    otherwise each child of the root is sharded (a LightningModule stays an ordinary module).
    ``fsdp=False`` stops after stage 3 (tests of the dispatch alone).
    """
    lay = mesh.layout
    check_model_for_layout(module, lay)
    if lay.tp > 1:
        _apply_tp(module, mesh)
    check_dispatcher(dispatcher)
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    dp_cp_group = mesh.group("dp_cp") if lay.dp * lay.cp > 1 else None
    exchanges: dict[int, Any] = {}  # one library buffer per expert count, shared by the layers
    for layer in layers:
        layer.aux_loss_group = dp_cp_group
        if lay.ep > 1 or lay.etp > 1:
            _shard_experts(layer.experts, mesh)
            groups = dict(ep_group=mesh.group("ep"), etp_group=mesh.group("etp"))
            num_experts = layer.config.num_experts
            if dispatcher in ("alltoall_dedup", "deepep", "hybridep"):
                if num_experts not in exchanges:
                    exchanges[num_experts] = _flex_exchange(dispatcher, mesh.group("ep"), num_experts)
                layer.dispatcher = FlexDispatcher(num_experts, **groups, exchange=exchanges[num_experts])
            else:
                kind = AllToAllDispatcher if dispatcher == "alltoall" else AllGatherDispatcher
                layer.dispatcher = kind(num_experts, **groups)
    if not fsdp or lay.world_size == 1:
        # One rank: FSDP2 would shard nothing and only copy (every parameter all-gathered into a
        # second buffer, every gradient packed for a reduce-scatter of one), so the model stays plain.
        return module
    scale = expert_grad_scale(lay)
    for layer in layers:
        fully_shard(
            layer.experts,
            mesh=mesh.mesh("edp"),
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=lambda p: Shard(1),
        )
        install_expert_grad_scaling(layer.experts, scale)  # type: ignore[arg-type]
        # The local (EP=1) path calls ``experts.forward_local`` instead of ``experts(...)``: FSDP
        # must all-gather the EDP shards around that method too, not only around ``forward``.
        if hasattr(layer.experts, "forward_local"):
            register_fsdp_forward_method(layer.experts, "forward_local")
    dense_mesh = mesh.mesh("dp_cp")
    for m in list(module.modules()):
        if isinstance(m, nn.ModuleList):
            for block in m:
                if _has_unmanaged_params(block):
                    fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
    if shard_root:
        fully_shard(module, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
        return module
    for child in module.children():
        if _has_unmanaged_params(child):
            fully_shard(child, mesh=dense_mesh, reshard_after_forward=reshard_after_forward)
    return module


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
