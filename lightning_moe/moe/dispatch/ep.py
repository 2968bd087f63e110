"""What every expert-parallel dispatcher shares: its groups, and the checks on them."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from lightning_moe.moe.dispatch.base import NO_EXTRAS, DispatcherCapabilities

__all__ = ["ExpertParallelDispatcher"]


class ExpertParallelDispatcher:
    """Experts sharded over ``ep_group`` (``E / ep`` local experts per rank).

    Args:
        num_experts: routed experts E in total (divisible by the EP group size).
        ep_group: the expert-parallel group (required; never WORLD by default).
        etp_group: the expert-tensor-parallel group when each expert's F dimension is sharded
            (``None``: ETP is 1). Its ranks hold identical tokens (tensor-parallel replicas);
            ``parallel/parallelize.py`` checks that.

    Capabilities: none beyond ``dispatch`` / ``combine`` (the rows come over the network, so
    recompute keeps them, and there is no fused expert call).
    """

    capabilities: DispatcherCapabilities = NO_EXTRAS

    def __init__(self, num_experts: int, *, ep_group: ProcessGroup, etp_group: ProcessGroup | None = None) -> None:
        ep = ep_group.size()
        if num_experts % ep:
            raise ValueError(
                f"{type(self).__name__}: num_experts={num_experts} is not divisible by the EP group size {ep}; "
                "choose ep dividing num_experts."
            )
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.etp_group = etp_group if etp_group is not None and etp_group.size() > 1 else None
        self.ep_size = ep
        self.ep_rank = ep_group.rank()
        self.num_local_experts = num_experts // ep

    def _reject_padding(self, capacity: int | None) -> None:
        if capacity is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: pad_to_capacity=True is not supported with expert parallelism yet; "
                "set pad_to_capacity=False (capacity drops still work)."
            )
