"""Token dispatchers and the token exchanges behind them (pure PyTorch, no Lightning imports).

A dispatcher moves routed tokens to their experts and back (``dispatch`` / ``combine``) and
declares anything more it offers in ``capabilities`` (:class:`DispatcherCapabilities`).

========================  =====================================================================
module                    holds
========================  =====================================================================
``base``                  the :class:`Dispatcher` protocol, :class:`DispatcherCapabilities`,
                          :class:`DispatchedTokens`, ``row_weights``
``local``                 :class:`LocalDispatcher`: all experts on this rank (layers start here)
``ep``                    :class:`ExpertParallelDispatcher`: groups and checks every EP one shares
``alltoall``              :class:`AllToAllDispatcher`: one row per routed slot, uneven A2A(EP)
``allgather``             :class:`AllGatherDispatcher`: AG(EP) of the tokens, RS(EP) back
``flex``                  :class:`FlexDispatcher` over a :class:`TokenExchange` (one row per
                          token and destination rank)
``exchange_alltoall_dedup``  :class:`AllToAllTokenExchange` (``"alltoall_dedup"``, plain NCCL)
``exchange_deepep``       :class:`DeepEPExchange` (``"deepep"``, optional ``deep_ep``)
``exchange_hybrid_ep``    :class:`HybridEPExchange` (``"hybridep"``, experimental)
``echo``, ``echo_plan``   ECHO: clones of hot experts in spare slots, and their planner
``comm``                  the differentiable collectives the dispatchers are built from
========================  =====================================================================
"""

from lightning_moe.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.base import (
    NO_EXTRAS,
    DispatchedTokens,
    Dispatcher,
    DispatcherCapabilities,
    row_weights,
)
from lightning_moe.moe.dispatch.echo import EchoDispatcher
from lightning_moe.moe.dispatch.ep import ExpertParallelDispatcher
from lightning_moe.moe.dispatch.exchange_alltoall_dedup import AllToAllTokenExchange
from lightning_moe.moe.dispatch.exchange_deepep import DeepEPExchange
from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange
from lightning_moe.moe.dispatch.flex import FlexDispatcher, TokenExchange
from lightning_moe.moe.dispatch.local import LocalDispatcher, LocalHandle

__all__ = [
    "NO_EXTRAS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AllToAllTokenExchange",
    "DeepEPExchange",
    "DispatchedTokens",
    "Dispatcher",
    "DispatcherCapabilities",
    "EchoDispatcher",
    "ExpertParallelDispatcher",
    "FlexDispatcher",
    "HybridEPExchange",
    "LocalDispatcher",
    "LocalHandle",
    "TokenExchange",
    "row_weights",
]
