"""Checks of plain configuration values, each failing early with the value and the fix.

Every check raises ``ValueError`` (``TypeError`` for a flag that is not a bool) worded
``{owner}: {name}={value!r} <broken rule>; <fix>.`` The configuration dataclasses declare their
fields' rules as rows of a table (:class:`FieldRule`, built with :func:`int_field`,
:func:`float_field`, :func:`bool_field` and :func:`choice_field`) and check them all with
:func:`check_fields`; other modules call the single checks directly.

Ground level: imports nothing of the package and no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple, get_args

__all__ = [
    "FieldRule",
    "bool_field",
    "check_bool",
    "check_choice",
    "check_fields",
    "check_float",
    "check_int",
    "choice_field",
    "float_field",
    "int_field",
]

FieldKind = Literal["int", "float", "bool", "choice"]


def check_int(owner: str, name: str, value: Any, minimum: int = 1, *, optional: bool = False, fix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= minimum`` (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = ", or None" if optional else ""
        fix = fix or f"set it to {minimum} or more"
        raise ValueError(f"{owner}: {name}={value!r} must be an int >= {minimum}{none}; {fix}.")


def check_float(
    owner: str,
    name: str,
    value: Any,
    minimum: float | None = 0.0,
    *,
    strict: bool = False,
    optional: bool = False,
    fix: str = "",
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number ``>= minimum`` (``> minimum`` when
    ``strict``; any finite number when ``minimum`` is ``None``).

    Ints are accepted, bools and strings are not; NaN and infinities are refused.
    """
    if optional and value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    below = minimum is not None and number and (value < minimum or (strict and value == minimum))
    if not number or not math.isfinite(value) or below:
        rule = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        none = ", or None" if optional else ""
        fix = fix or (f"use a value{rule}" if rule else "use a finite number")
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number{rule}{none}; {fix}.")


def check_bool(owner: str, name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} is not a bool; write {name}=True or {name}=False.")


def check_choice(
    owner: str, name: str, value: Any, choices: tuple[str, ...], removed: Mapping[str, str] | None = None
) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``.

    ``removed`` maps values that were once accepted to what to use instead; such a value gets that
    advice rather than the bare list.
    """
    if value in choices:
        return
    if removed and isinstance(value, str) and value in removed:
        raise ValueError(f"{owner}: {name}={value!r} was removed; {removed[value]}.")
    raise ValueError(f"{owner}: {name}={value!r} is not one of {choices}; choose one of them.")


class FieldRule(NamedTuple):
    """One row of a configuration table: the field, its kind, its bounds and the fix to print."""

    name: str
    kind: FieldKind
    minimum: float | None = None  # int / float: the least value allowed (None: any finite float)
    strict: bool = False  # float: the value must exceed ``minimum``
    optional: bool = False  # int / float: ``None`` is accepted (the feature is off)
    choices: tuple[str, ...] = ()  # choice: the values of the field's ``Literal``
    removed: tuple[tuple[str, str], ...] = ()  # choice: (former value, what to use instead)
    fix: str = ""


def int_field(name: str, minimum: int = 1, *, optional: bool = False, fix: str = "") -> FieldRule:
    """An int ``>= minimum`` (never a bool), or ``None`` when ``optional``."""
    return FieldRule(name, "int", minimum=minimum, optional=optional, fix=fix)


def float_field(
    name: str, minimum: float | None = 0.0, *, strict: bool = False, optional: bool = False, fix: str = ""
) -> FieldRule:
    """A finite real number ``>= minimum`` (``> minimum`` when ``strict``; any when ``minimum`` is ``None``)."""
    return FieldRule(name, "float", minimum=minimum, strict=strict, optional=optional, fix=fix)


def bool_field(name: str) -> FieldRule:
    """``True`` or ``False``."""
    return FieldRule(name, "bool")


def choice_field(name: str, literal: Any, removed: Mapping[str, str] | None = None) -> FieldRule:
    """One of the values of the ``Literal`` type ``literal``; ``removed``: former values and their replacement."""
    return FieldRule(name, "choice", choices=get_args(literal), removed=tuple((removed or {}).items()))


def check_fields(owner: str, obj: object, rules: Iterable[FieldRule]) -> None:
    """Check every rule of the table ``rules`` against ``obj``'s attribute of that name, in order."""
    for rule in rules:
        value = getattr(obj, rule.name)
        if rule.kind == "int":
            check_int(owner, rule.name, value, int(rule.minimum or 0), optional=rule.optional, fix=rule.fix)
        elif rule.kind == "float":
            check_float(owner, rule.name, value, rule.minimum, strict=rule.strict, optional=rule.optional, fix=rule.fix)
        elif rule.kind == "bool":
            check_bool(owner, rule.name, value)
        else:
            check_choice(owner, rule.name, value, rule.choices, dict(rule.removed))
