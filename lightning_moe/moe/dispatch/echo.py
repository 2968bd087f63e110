"""ECHO dispatcher: an EP dispatcher whose hot experts also run as clones on other ranks.

Legend: T tokens, H hidden, F expert FFN width, K slots per token, P ranks of the EP group,
e home experts per rank, S spare slots per rank, R rows this rank's home experts process, C rows
its clone slots process.

It wraps the layer's :class:`~lightning_moe.moe.dispatch.alltoall.AllToAllDispatcher` (or its
:class:`~lightning_moe.moe.dispatch.flex.FlexDispatcher` over the deduplicating
``alltoall_dedup`` exchange, which takes any expert count per call) and keeps the layer unchanged: the layer's experts still see only their e home experts. Without a plan
(``plan is None``) every call goes to the wrapped dispatcher as is.

Stages of ``dispatch`` with a plan (:class:`~lightning_moe.moe.dispatch.echo_plan.EchoPlan`):

1. physical ids (local): ``plan.physical_ids`` splits each hot expert's slots between its home
   and its clones (no communication);
2. a dispatcher of the wrapped one's kind over ``P * (e + S)`` expert slots (the all-to-all:
   A2A(EP) of the counts, # SYNC: split sizes to host, A2A(EP) of rows and weights, regroup by
   slot; the flex one: its exchange, then the local sort by slot);
3. split (local; # SYNC: the home row count): the first R rows (home experts) go to the layer,
   the last C rows (spare slots) stay in the handle.

Stages of ``combine``:

1. clone experts (local): the grouped SwiGLU MLP of the C clone rows with the clone weights
   (weighted inside the activation exactly when the layer's experts were);
2. concatenate home and clone outputs; the physical combine: A2A(EP) back and the gather-sum.

Weights and gradients of the clones (collectives over the EP group, called by the callback):

* :meth:`EchoDispatcher.refresh_clones` — after every optimizer step and every new plan:
  A2A(EP) of ``[w13 | w2]`` of each cloned expert from its home rank into the spare slot;
* :meth:`EchoDispatcher.reduce_clone_grads` — before every optimizer step: the reverse A2A(EP)
  of the clone gradients, multiplied by ``scale`` and added to the home expert's gradient.

Clone weights are plain tensors held here, never module parameters or buffers: a checkpoint
never sees them and a resumed run starts without clones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher, AllToAllHandle
from lightning_moe.moe.dispatch.base import NO_EXTRAS, DispatchedTokens, DispatcherCapabilities
from lightning_moe.moe.dispatch.echo_plan import EchoPlan
from lightning_moe.moe.dispatch.flex import FlexDispatcher
from lightning_moe.moe.experts import GroupedExperts
from lightning_moe.ops.expert_mlp import expert_swiglu_mlp
from lightning_moe.ops.grouped_gemm import offsets_from_counts

__all__ = ["EchoDispatcher", "EchoHandle", "physical_dispatcher"]


@dataclass(frozen=True)
class EchoHandle:
    inner: Any  # the physical (or, without a plan, the wrapped) dispatcher's handle
    x_CH: torch.Tensor | None  # rows of the clone slots (None without a plan)
    tokens_per_slot_S: torch.Tensor | None
    weights_C: torch.Tensor | None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def physical_dispatcher(base: Any, num_slots: int) -> AllToAllDispatcher | FlexDispatcher:
    """A dispatcher of ``base``'s kind, over the same EP group, for ``num_slots`` expert slots."""
    if isinstance(base, AllToAllDispatcher):
        return AllToAllDispatcher(num_slots, ep_group=base.ep_group)
    if isinstance(base, FlexDispatcher) and base.exchange.takes_any_expert_count:
        return FlexDispatcher(num_slots, ep_group=base.ep_group, exchange=base.exchange)
    name = base.exchange.name if isinstance(base, FlexDispatcher) else type(base).__name__
    raise NotImplementedError(
        f"ECHO: the layer's dispatcher ({name}) cannot carry clones; use FoldedMoEStrategy(dispatcher='alltoall') "
        "or dispatcher='alltoall_dedup'."
    )


def _rows_per_rank(handle: Any, ids_TK: torch.Tensor, slots_per_rank: int, ranks: int) -> torch.Tensor:
    """Rows this rank sends to each EP rank's experts (int64 ``[P]``): from the all-to-all's host splits,
    else counted on the device from the routed slots (no sync)."""
    if isinstance(handle, AllToAllHandle):
        return torch.tensor(handle.send_splits, dtype=torch.int64)
    kept = ids_TK[ids_TK >= 0]
    return torch.bincount(torch.div(kept, slots_per_rank, rounding_mode="floor"), minlength=ranks)


class EchoDispatcher:
    """Expert parallelism with S spare expert slots per EP rank for clones of hot experts.

    Args:
        base: the layer's all-to-all dispatcher, or its flex dispatcher over ``alltoall_dedup`` (its
            EP group and exchange are reused; ETP is not supported).
        experts: the layer's experts (home weights, GEMM backend and shapes).
        spare_slots: S.

    Capabilities: none beyond ``dispatch`` / ``combine`` (like the expert-parallel dispatcher it wraps).
    """

    capabilities: DispatcherCapabilities = NO_EXTRAS

    def __init__(self, base: AllToAllDispatcher | FlexDispatcher, experts: GroupedExperts, spare_slots: int) -> None:
        if base.etp_group is not None:
            raise NotImplementedError(
                "EchoDispatcher: expert tensor parallelism (etp > 1) is not supported with ECHO yet; set etp=1."
            )
        if spare_slots < 1:
            raise ValueError(f"EchoDispatcher: spare_slots={spare_slots} must be >= 1.")
        if experts.b13 is not None or not experts.swiglu.is_plain:
            raise NotImplementedError(
                "EchoDispatcher: the clone experts compute the plain SwiGLU without biases, these experts have "
                f"mlp_bias={experts.b13 is not None}, swiglu={tuple(experts.swiglu)}; drop the ECHO callback."
            )
        self.base = base
        self.experts = experts
        self.spare_slots = spare_slots
        self.num_experts = base.num_experts
        self.num_local_experts = base.num_local_experts
        self.ep_group = base.ep_group
        self.ep_size = base.ep_size
        self.ep_rank = base.ep_rank
        self.etp_group = None
        e = self.num_local_experts
        w13, w2 = _local(experts.w13), _local(experts.w2)
        H, F = experts.hidden_size, experts.ffn_hidden_size
        if tuple(w13.shape) != (e, H, 2 * F) or tuple(w2.shape) != (e, F, H):
            raise NotImplementedError(
                f"EchoDispatcher: local expert weights have shapes {tuple(w13.shape)} / {tuple(w2.shape)}, expected "
                f"{(e, H, 2 * F)} / {(e, F, H)} (all of this rank's experts, unsharded); ECHO needs edp=1."
            )
        self.physical = physical_dispatcher(base, self.ep_size * (e + spare_slots))
        self.plan: EchoPlan | None = None
        S = spare_slots
        self.clone_w13 = torch.zeros(S, H, 2 * F, dtype=w13.dtype, device=w13.device, requires_grad=True)
        self.clone_w2 = torch.zeros(S, F, H, dtype=w2.dtype, device=w2.device, requires_grad=True)
        self.last_rows_per_ep_rank: torch.Tensor | None = None  # [P] rows sent to each EP rank

    # --- dispatch / combine ---------------------------------------------------------------------

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, capacity: int | None
    ) -> tuple[DispatchedTokens, EchoHandle]:
        if self.plan is None:
            dispatched, handle = self.base.dispatch(x_TH, topk_ids_TK, topk_weights_TK, capacity)
            self.last_rows_per_ep_rank = _rows_per_rank(handle, topk_ids_TK, self.num_local_experts, self.ep_size)
            return dispatched, EchoHandle(handle, None, None, None)
        e = self.num_local_experts
        physical_ids_TK = self.plan.physical_ids(topk_ids_TK)
        dispatched, handle = self.physical.dispatch(x_TH, physical_ids_TK, topk_weights_TK, capacity)
        self.last_rows_per_ep_rank = _rows_per_rank(handle, physical_ids_TK, e + self.spare_slots, self.ep_size)
        tokens_per_slot = dispatched.tokens_per_expert_e
        num_home = int(tokens_per_slot[:e].sum())  # SYNC: where the clone rows start
        home = DispatchedTokens(dispatched.x_RH[:num_home], tokens_per_slot[:e], dispatched.weights_R[:num_home])
        echo = EchoHandle(handle, dispatched.x_RH[num_home:], tokens_per_slot[e:], dispatched.weights_R[num_home:])
        return home, echo

    def combine(self, y_RH: torch.Tensor, handle: EchoHandle, weighted: bool) -> torch.Tensor:
        if handle.x_CH is None:
            return self.base.combine(y_RH, handle.inner, weighted)
        y_CH = self._clone_experts(handle, weighted).to(y_RH.dtype)
        return self.physical.combine(torch.cat([y_RH, y_CH]), handle.inner, weighted)

    def _clone_experts(self, handle: EchoHandle, weighted: bool) -> torch.Tensor:
        """The same math as ``GroupedExperts.forward``, on the clone rows and clone weights."""
        x_CH = handle.x_CH
        assert x_CH is not None and handle.tokens_per_slot_S is not None
        if x_CH.shape[0] == 0:
            return x_CH.new_zeros(0, self.experts.hidden_size)
        device_type = x_CH.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = self.clone_w13.dtype
        backend = self.experts.gemm_backend(x_CH.device, dtype)
        offs_S = offsets_from_counts(handle.tokens_per_slot_S)
        w_C = None if weighted else handle.weights_C
        with torch.autocast(device_type=device_type, enabled=False):
            return expert_swiglu_mlp(
                x_CH.to(dtype), self.clone_w13.to(dtype), self.clone_w2.to(dtype), offs_S, w_C, backend,
                self.experts.gemm_kernel, self.experts.gemm_tile, self.experts.wgrad_kernel,
            )

    # --- clone weights and gradients (collectives over the EP group) ------------------------------

    def _routes(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Transfers of the current plan, in an order every rank agrees on.

        ``sends``: (destination rank, its spare slot, my local expert) for clones of my experts;
        ``recvs``: (source rank, my spare slot, its local expert) for my spare slots. Both are
        sorted by (peer rank, slot), the order of the all-to-all buffers.
        """
        assert self.plan is not None
        e, me = self.num_local_experts, self.ep_rank
        sends, recvs = [], []
        for p, row in enumerate(self.plan.clone_expert_PS.tolist()):
            for j, g in enumerate(row):
                if g < 0:
                    continue
                if g // e == me:
                    sends.append((p, j, g % e))
                if p == me:
                    recvs.append((g // e, j, g % e))
        return sorted(sends), sorted(recvs)

    def _splits(self, routes: list[tuple[int, int, int]]) -> list[int]:
        counts = [0] * self.ep_size
        for peer, _, _ in routes:
            counts[peer] += 1
        return counts

    def _exchange_pairs(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        rows: list[int],
        sent: list[tuple[int, int, int]],
        received: list[tuple[int, int, int]],
    ) -> tuple[torch.Tensor, int]:
        """All-to-all over EP of ``a[r]`` and ``b[r]`` for each ``r`` of ``rows`` (in ``sent``'s order),
        packed as one row each in ``a``'s dtype; the received rows (in ``received``'s order) and
        the column where ``b``'s part starts."""
        n_a = a[0].numel()
        send_RW = a.new_zeros(len(rows), n_a + b[0].numel())
        for i, r in enumerate(rows):
            send_RW[i, :n_a] = a[r].reshape(-1)
            send_RW[i, n_a:] = b[r].reshape(-1).to(a.dtype)
        recv_RW = a.new_empty(len(received), send_RW.shape[1])
        dist.all_to_all_single(recv_RW, send_RW, self._splits(received), self._splits(sent), group=self.ep_group)
        return recv_RW, n_a

    @torch.no_grad()
    def refresh_clones(self) -> None:
        """Copy every cloned expert's current weights from its home rank (A2A over EP)."""
        if self.plan is None:
            return
        sends, recvs = self._routes()
        w13, w2 = _local(self.experts.w13), _local(self.experts.w2)
        recv_RW, n13 = self._exchange_pairs(w13, w2, [local for _, _, local in sends], sends, recvs)
        self.clone_w13.zero_()
        self.clone_w2.zero_()
        for i, (_, slot, _) in enumerate(recvs):
            self.clone_w13[slot].copy_(recv_RW[i, :n13].view_as(self.clone_w13[slot]))
            self.clone_w2[slot].copy_(recv_RW[i, n13:].view_as(self.clone_w2[slot]))

    @torch.no_grad()
    def reduce_clone_grads(self, scale: float = 1.0) -> None:
        """Add ``scale`` times each clone's gradient to its home expert's gradient (A2A over EP).

        ``scale`` must be the factor the strategy applies to expert gradients (FSDP's
        reduce-scatter hook), so that clone and home contributions end on the same footing.
        The clone gradients are cleared afterwards.
        """
        if self.plan is None:
            self.clone_w13.grad = None
            self.clone_w2.grad = None
            return
        sends, recvs = self._routes()  # gradients travel the reverse way: recvs send, sends receive
        g13 = self.clone_w13.grad if self.clone_w13.grad is not None else torch.zeros_like(self.clone_w13)
        g2 = self.clone_w2.grad if self.clone_w2.grad is not None else torch.zeros_like(self.clone_w2)
        recv_RW, n13 = self._exchange_pairs(g13, g2, [slot for _, slot, _ in recvs], recvs, sends)
        for name, part in (("w13", slice(0, n13)), ("w2", slice(n13, recv_RW.shape[1]))):
            param = getattr(self.experts, name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = _local(param.grad)
            for i, (_, _, local) in enumerate(sends):
                grad[local].add_(recv_RW[i, part].view_as(grad[local]).to(grad.dtype), alpha=scale)
        self.clone_w13.grad = None
        self.clone_w2.grad = None

    def __repr__(self) -> str:
        clones = 0 if self.plan is None else self.plan.num_clones
        return (
            f"EchoDispatcher(num_experts={self.num_experts}, ep={self.ep_size}, spare_slots={self.spare_slots}, "
            f"active_clones={clones})"
        )
