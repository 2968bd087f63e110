"""ECHO planner: clone hot experts into spare slots of under-loaded EP ranks (pure torch).

Legend: P ranks of the expert-parallel (EP) group, e home experts per rank, E = P*e experts,
S spare slots per rank, T tokens, K slots per token, N = T*K, M replicas per expert at most.

**Physical slots.** With cloning every EP rank runs ``e + S`` expert slots: rank p owns the
physical ids ``[p*(e+S), (p+1)*(e+S))``, its e home experts first (expert g sits at
``(g // e)*(e+S) + g % e``), then its S spare slots, each empty or holding a copy of one expert
homed on another rank.

**Plan** (:func:`plan_clones`, from the per-expert token counts ``c_E`` summed over the EP group).
With rank loads ``L_p`` (the summed counts of the pieces a rank processes) and the balanced
share ``target = sum(c) / P``, repeat while the busiest rank exceeds ``target * (1 + tolerance)``
and spare slots remain:

1. ``p_hi``: the busiest rank; its pieces (home or clone) are tried largest first;
2. ``p_lo``: the least-loaded rank with a free slot that holds no replica of that expert yet;
3. move ``min(L_hi - target, target - L_lo, piece)`` tokens of that expert into a new clone on
   ``p_lo`` (so neither rank crosses the balanced share).

Each expert g ends with replicas ``j = 0..m`` (home first) carrying shares ``f_j`` of its
tokens (``sum_j f_j = 1``), kept as cumulative cuts ``u_j = f_0 + ... + f_j``.

**Split** (:meth:`EchoPlan.physical_ids`, per source rank, no communication). This rank's ``n_g``
slots routed to expert g, in (token, k) order, are cut at ``floor(u_j * n_g)``: slot number r goes
to replica j when ``floor(u_{j-1} n_g) <= r < floor(u_j n_g)``. Every source applies the planned
shares to its own tokens, so the replicas receive about ``f_j`` of g's tokens in total.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EchoPlan", "identity_plan", "plan_clones"]

_NO_CUT = 2.0  # padding cut beyond every real cut (1.0), so padding replicas are never chosen


@dataclass(frozen=True)
class EchoPlan:
    """Clone placement and token shares of one MoE layer (identical on every EP rank).

    Attributes:
        ep_size: P.
        num_local_experts: e (home experts per rank).
        spare_slots: S.
        clone_expert_PS: ``[P, S]`` global expert copied into each spare slot, ``-1`` if empty.
        replica_slot_EM: ``[E, M]`` physical slot of each replica of each expert (home first);
            padding repeats the last replica.
        replica_cut_EM: ``[E, M]`` cumulative token shares ``u_j`` (float64; the last real one is
            exactly 1.0, padding is 2.0).
    """

    ep_size: int
    num_local_experts: int
    spare_slots: int
    clone_expert_PS: torch.Tensor
    replica_slot_EM: torch.Tensor
    replica_cut_EM: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.ep_size * self.num_local_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_local_experts + self.spare_slots

    @property
    def num_clones(self) -> int:
        return int((self.clone_expert_PS >= 0).sum())

    def home_slot(self, expert: int) -> int:
        """Physical slot of expert ``expert``'s home copy."""
        e = self.num_local_experts
        return (expert // e) * self.slots_per_rank + expert % e

    def physical_ids(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """Map logical expert ids ``[T, K]`` to physical slots, splitting hot experts (see module doc).

        Ids ``< 0`` (slots dropped by capacity) stay ``-1``. Deterministic: the split follows
        the (token, k) order of this rank's slots.
        """
        E = self.num_experts
        ids_N = topk_ids_TK.reshape(-1).long()
        valid_N = ids_N >= 0
        key_N = torch.where(valid_N, ids_N, torch.full_like(ids_N, E))
        order_N = torch.argsort(key_N, stable=True)
        counts_E1 = torch.bincount(key_N, minlength=E + 1)
        start_E1 = torch.cumsum(counts_E1, 0) - counts_E1
        rank_sorted_N = torch.arange(ids_N.numel(), device=ids_N.device) - start_E1[key_N[order_N]]
        rank_N = torch.empty_like(rank_sorted_N).scatter_(0, order_N, rank_sorted_N)
        expert_N = ids_N.clamp(min=0)
        slot_EM = self.replica_slot_EM.to(ids_N.device)
        cut_EM = self.replica_cut_EM.to(ids_N.device)
        n_N = counts_E1[expert_N].double()
        bounds_NM = torch.floor(cut_EM[expert_N] * n_N.unsqueeze(1))
        replica_N = (rank_N.double().unsqueeze(1) >= bounds_NM).sum(1).clamp(max=slot_EM.shape[1] - 1)
        phys_N = slot_EM[expert_N, replica_N]
        return torch.where(valid_N, phys_N, torch.full_like(phys_N, -1)).view_as(topk_ids_TK)

    def planned_rank_load(self, load_E: torch.Tensor) -> torch.Tensor:
        """``[P]`` tokens each rank would process if the shares were met exactly (float64)."""
        load_E = load_E.double().cpu()
        cut_EM = self.replica_cut_EM.clamp(max=1.0)
        share_EM = torch.diff(cut_EM, dim=1, prepend=torch.zeros(cut_EM.shape[0], 1, dtype=cut_EM.dtype))
        rank_EM = self.replica_slot_EM // self.slots_per_rank
        out_P = torch.zeros(self.ep_size, dtype=torch.float64)
        return out_P.index_add_(0, rank_EM.reshape(-1), (share_EM * load_E.unsqueeze(1)).reshape(-1))


def _check(num_experts: int, ep_size: int, spare_slots: int) -> None:
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"plan_clones: ep_size={ep_size} must be >= 1 and divide num_experts={num_experts}.")
    if spare_slots < 0:
        raise ValueError(f"plan_clones: spare_slots={spare_slots} must be >= 0.")


def identity_plan(num_experts: int, ep_size: int, spare_slots: int) -> EchoPlan:
    """No clones: every expert keeps all its tokens at home."""
    _check(num_experts, ep_size, spare_slots)
    return _build(
        num_experts, ep_size, spare_slots, {g: [(g // (num_experts // ep_size), 1.0)] for g in range(num_experts)}, {}
    )


def plan_clones(load_E: torch.Tensor, ep_size: int, spare_slots: int, tolerance: float = 0.0) -> EchoPlan:
    """Place clones of hot experts into spare slots so every rank nears ``sum(load) / P``.

    Args:
        load_E: ``[E]`` tokens routed to each expert, summed over the EP group (any dtype).
        ep_size: P; expert g is homed on rank ``g // (E / P)``.
        spare_slots: S spare slots per rank.
        tolerance: stop once the busiest rank is within ``(1 + tolerance)`` of the balanced share.
    """
    E = int(load_E.numel())
    _check(E, ep_size, spare_slots)
    if tolerance < 0:
        raise ValueError(f"plan_clones: tolerance={tolerance} must be >= 0.")
    e, P = E // ep_size, ep_size
    load = [float(v) for v in load_E.detach().double().cpu().tolist()]  # SYNC: planning runs on host
    target = sum(load) / P
    # pieces[g] = [[rank, amount], ...], home first
    pieces: dict[int, list[list[float]]] = {g: [[g // e, load[g]]] for g in range(E)}
    rank_load = [sum(load[p * e : (p + 1) * e]) for p in range(P)]
    clones: dict[tuple[int, int], int] = {}  # (rank, spare index) -> expert
    free = [spare_slots] * P
    for _ in range(P * spare_slots):
        p_hi = max(range(P), key=lambda p: (rank_load[p], -p))
        if target <= 0 or rank_load[p_hi] <= target * (1.0 + tolerance):
            break
        candidates = sorted(
            (
                (g, i, piece[1])
                for g, ps in pieces.items()
                for i, piece in enumerate(ps)
                if piece[0] == p_hi and piece[1] > 0
            ),
            key=lambda t: (-t[2], t[0]),
        )
        moved = False
        for g, i, amount in candidates:
            holders = {int(piece[0]) for piece in pieces[g]}
            dests = [p for p in range(P) if free[p] > 0 and p not in holders]
            if not dests:
                continue
            p_lo = min(dests, key=lambda p: (rank_load[p], p))
            move = min(rank_load[p_hi] - target, target - rank_load[p_lo], amount)
            if move <= 0:
                continue
            pieces[g][i][1] -= move
            pieces[g].append([p_lo, move])
            clones[(p_lo, spare_slots - free[p_lo])] = g
            free[p_lo] -= 1
            rank_load[p_hi] -= move
            rank_load[p_lo] += move
            moved = True
            break
        if not moved:
            break
    shares = {
        g: [(int(rank), (amount / load[g]) if load[g] > 0 else float(j == 0)) for j, (rank, amount) in enumerate(ps)]
        for g, ps in pieces.items()
    }
    return _build(E, P, spare_slots, shares, clones)


def _build(
    E: int, P: int, S: int, shares: dict[int, list[tuple[int, float]]], clones: dict[tuple[int, int], int]
) -> EchoPlan:
    e = E // P
    per_rank = e + S
    clone_expert_PS = torch.full((P, S), -1, dtype=torch.long)
    slot_of: dict[tuple[int, int], int] = {}  # (expert, rank) -> physical slot
    for (p, j), g in clones.items():
        clone_expert_PS[p, j] = g
        slot_of[(g, p)] = p * per_rank + e + j
    M = max(len(v) for v in shares.values())
    slot_EM = torch.zeros(E, M, dtype=torch.long)
    cut_EM = torch.full((E, M), _NO_CUT, dtype=torch.float64)
    for g, replicas in shares.items():
        total = 0.0
        for j, (rank, share) in enumerate(replicas):
            total += share
            slot_EM[g, j] = (g // e) * per_rank + g % e if j == 0 else slot_of[(g, rank)]
            cut_EM[g, j] = total
        cut_EM[g, len(replicas) - 1] = 1.0  # exact: rounding never leaves a token unassigned
        slot_EM[g, len(replicas) :] = slot_EM[g, len(replicas) - 1]
    return EchoPlan(P, e, S, clone_expert_PS, slot_EM, cut_EM)
