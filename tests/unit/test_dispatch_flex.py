"""Flex dispatcher (DeepEP, Hybrid-EP): bad input on one process (parity runs in tests/dist)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from lightning_moe.moe.dispatch.exchange_deepep import make_deep_ep_buffer
from lightning_moe.moe.dispatch.exchange_hybrid_ep import HybridEPExchange, warn_hybrid_ep_experimental
from lightning_moe.parallel.parallelize import check_dispatcher
from lightning_moe.strategies.fabric import FabricFoldedMoEStrategy
from lightning_moe.strategies.folded_moe import FoldedMoEStrategy


class _Group:
    def size(self) -> int:
        return 2


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed here")
def test_missing_deep_ep_names_the_package_and_the_alternative() -> None:
    with pytest.raises(ImportError, match=r"deep_ep is not importable.*dispatcher='alltoall'"):
        make_deep_ep_buffer(None)  # type: ignore[arg-type]
    with pytest.raises(ImportError, match=r"Hybrid-EP exchange: deep_ep is not importable.*dispatcher='alltoall'"):
        HybridEPExchange(_Group(), 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", [FoldedMoEStrategy, FabricFoldedMoEStrategy])
def test_unknown_dispatcher_is_refused_at_construction(strategy: type) -> None:
    with pytest.raises(ValueError, match=r"dispatcher='a2a' is unknown; choose one of \('alltoall', 'alltoall_dedup', 'allgather', 'deepep', 'hybridep'\)"):
        strategy(dispatcher="a2a")
    assert strategy(dispatcher="deepep").dispatcher == "deepep"


def test_check_dispatcher_accepts_the_five_kinds() -> None:
    for kind in ("alltoall", "alltoall_dedup", "allgather", "deepep", "hybridep"):
        check_dispatcher(kind)
    with pytest.raises(ValueError, match="dispatcher='deep_ep' is unknown"):
        check_dispatcher("deep_ep")


def test_hybrid_ep_warns_once_per_process_that_it_is_experimental() -> None:
    warn_hybrid_ep_experimental.cache_clear()  # as if no Hybrid-EP exchange was built in this process yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            HybridEPExchange(_Group(), 8, make_buffer=lambda hidden, tokens: None)  # type: ignore[arg-type]
    experimental = [w for w in caught if "experimental" in str(w.message)]
    assert len(experimental) == 1
    assert experimental[0].category is UserWarning
    assert "dispatcher='hybridep' is experimental" in str(experimental[0].message)
