"""``ops/deferred.py``: a deferred value is computed once, on its first read, and then kept."""

from __future__ import annotations

import torch

from lightning_moe.moe.router import RouterOutput
from lightning_moe.ops.deferred import ResolvedOnRead
from lightning_moe.ops.permute import count_per_expert


class _Holder:
    __slots__ = ("_value",)
    value = ResolvedOnRead()

    def __init__(self, value: object) -> None:
        self._value = value


def test_a_deferred_value_is_computed_on_the_first_read_only() -> None:
    calls: list[int] = []

    def compute() -> torch.Tensor:
        calls.append(1)
        return torch.arange(3)

    holder = _Holder(compute)
    assert calls == []
    first, second = holder.value, holder.value
    assert calls == [1]
    assert first is second
    assert first.tolist() == [0, 1, 2]


def test_a_tensor_is_read_as_it_is() -> None:
    tensor = torch.ones(2)
    assert _Holder(tensor).value is tensor


def test_router_output_counts_the_routed_ids_when_no_counts_are_given() -> None:
    routed_ids_TK = torch.tensor([[0, 2], [2, 3], [1, 2]])
    logits_TE = torch.zeros(3, 5)
    output = RouterOutput(logits_TE, routed_ids_TK, torch.ones(3, 2), None, routed_ids_TK)
    assert output.tokens_per_expert_E.tolist() == count_per_expert(routed_ids_TK, 5).tolist() == [1, 1, 3, 1, 0]
