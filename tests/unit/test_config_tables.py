"""The configuration dataclasses check every field from one table row, and each choice from its ``Literal``."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest

from lightning_moe import config
from lightning_moe.checks import check_choice, check_float, check_int
from lightning_moe.config import Fp8Config, KernelConfig, MoEConfig

TABLES = {
    KernelConfig: config._KERNEL_RULES,
    Fp8Config: config._FP8_RULES,
    MoEConfig: config._MOE_RULES,
}
NESTED = {"kernels", "fp8"}  # MoEConfig's nested configurations: built and type-checked, not a row


@pytest.mark.parametrize("cls", list(TABLES), ids=lambda c: c.__name__)
def test_every_field_has_exactly_one_row(cls: type) -> None:
    rows = [rule.name for rule in TABLES[cls]]
    fields = [f.name for f in dataclasses.fields(cls) if f.name not in NESTED]
    assert sorted(rows) == sorted(fields)


@pytest.mark.parametrize("cls", list(TABLES), ids=lambda c: c.__name__)
def test_choice_rows_are_the_literal_of_their_field(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for rule in TABLES[cls]:
        literal = typing.get_origin(hints[rule.name]) is typing.Literal
        assert (rule.kind == "choice") == literal, rule.name
        if literal:
            assert rule.choices == typing.get_args(hints[rule.name]), rule.name


def test_no_hand_written_copy_of_a_literal_is_left_in_the_config_module() -> None:
    tuples = {v for k, v in vars(config).items() if isinstance(v, tuple) and v and all(isinstance(x, str) for x in v)}
    literals = {typing.get_args(v) for v in vars(config).values() if typing.get_origin(v) is typing.Literal}
    assert not tuples & literals


def test_swiglu_up_offset_takes_any_finite_number() -> None:
    base = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    assert MoEConfig(**base, swiglu_up_offset=-3.5).swiglu_up_offset == -3.5
    with pytest.raises(ValueError, match=re.escape("swiglu_up_offset=inf must be a finite number; use e.g. 0.0")):
        MoEConfig(**base, swiglu_up_offset=math.inf)


def test_the_single_checks_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=re.escape("Owner: n=0 must be an int >= 1; set it to 1 or more.")):
        check_int("Owner", "n", 0)
    with pytest.raises(ValueError, match=re.escape("Owner: x=-1 must be a finite number >= 0, or None; use 0.")):
        check_float("Owner", "x", -1, optional=True, fix="use 0")
    with pytest.raises(ValueError, match=re.escape("Owner: k='b' is not one of ('a',); choose one of them.")):
        check_choice("Owner", "k", "b", ("a",))
    with pytest.raises(ValueError, match=re.escape("Owner: k='old' was removed; use k='a'.")):
        check_choice("Owner", "k", "old", ("a",), {"old": "use k='a'"})
    check_float("Owner", "x", None, optional=True)
    check_int("Owner", "n", 0, minimum=0)
