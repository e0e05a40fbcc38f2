"""Declarative checks of a dataclass's fields: each field lists the constraints its value must meet in its
metadata (`field(metadata=rules(positive_int))`), and `violations` returns every field that breaks one, so
that one error can name them all instead of stopping at the first.

A constraint may read other fields (`refs`): it is checked only when those fields met their own
constraints, so one bad value is reported once, where it is, and not again through every field that
depends on it. A field reports its first broken constraint only (the later ones usually follow from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

RULES = "constraints"  # the metadata key of a field's constraints


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a field's value must be. `holds(value, obj)` says whether it is (an exception counts as no);
    `says` the requirement, formatted with the object's fields and followed by the value (`"must divide
    num_experts={num_experts}"` gives "must divide num_experts=8, got 3"), or a function of (value, obj)
    giving the whole message. `refs`: the other fields it
    reads (and those `when` reads); `when`: the constraint applies only when this holds for the object."""

    holds: Callable[[Any, Any], bool]
    says: str | Callable[[Any, Any], str]
    refs: tuple[str, ...] = ()
    when: Callable[[Any], bool] | None = None

    def __call__(self, value: Any, obj: Any) -> str | None:
        """The broken requirement as a message, or None when the constraint holds or does not apply."""
        try:
            if self.when is not None and not self.when(obj):
                return None
            if self.holds(value, obj):
                return None
        except (TypeError, ValueError, ArithmeticError, AttributeError):
            pass
        if callable(self.says):
            return self.says(value, obj)
        return self.says.format(**vars(obj)) + f", got {value!r}"

    def only_when(self, when: Callable[[Any], bool], refs: Iterable[str] = ()) -> Constraint:
        """This constraint where `when` holds for the object (`refs`: the fields `when` reads)."""
        return dataclasses.replace(self, when=when, refs=(*self.refs, *refs))


@dataclasses.dataclass(frozen=True)
class Problem:
    """A field that breaks a constraint: its name as the user wrote it, and what it must be."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"'{self.field}': {self.message}"


def rules(*constraints: Constraint, label: str | None = None) -> dict[str, Any]:
    """A field's metadata: its constraints, checked in order, and the name its problems go by (`label`,
    e.g. the key a config file writes; the field's own name when None)."""
    return {RULES: constraints, "label": label}


def violations(cls: Any, values: Mapping[str, Any], unknown: Iterable[str] = ()) -> list[Problem]:
    """Every field of dataclass `cls` whose value in `values` breaks one of its constraints, in the fields'
    order. `unknown`: fields already found bad (or missing) elsewhere: not checked, and constraints that read
    them are skipped."""
    obj = SimpleNamespace(**values)
    bad = set(unknown)
    fields = [f for f in dataclasses.fields(cls) if f.name not in bad]
    failed: dict[str, str] = {}
    # A field's own constraints (those reading no other field) first, for every field: a constraint that
    # reads other fields is checked only when they met theirs.
    for f in fields:
        for rule in f.metadata.get(RULES, ()):
            if not rule.refs and (message := rule(values[f.name], obj)) is not None:
                failed[f.name] = message
                break
    unusable = bad | set(failed)
    for f in fields:
        for rule in () if f.name in failed else f.metadata.get(RULES, ()):
            if rule.refs and unusable.isdisjoint(rule.refs) and (message := rule(values[f.name], obj)):
                failed[f.name] = message
                break
    return [Problem(f.metadata.get("label") or f.name, failed[f.name]) for f in fields if f.name in failed]


# --- the vocabulary ---------------------------------------------------------------------------------------


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


integer = Constraint(lambda v, _: is_int(v), "must be an integer")
positive_int = Constraint(lambda v, _: is_int(v) and v > 0, "must be a positive integer")
non_negative_int = Constraint(lambda v, _: is_int(v) and v >= 0, "must be a non-negative integer")
positive = Constraint(lambda v, _: _is_number(v) and v > 0, "must be positive")
negative = Constraint(lambda v, _: _is_number(v) and v < 0, "must be negative")
boolean = Constraint(lambda v, _: isinstance(v, bool), "must be true or false")


def int_at_least(low: int) -> Constraint:
    return Constraint(lambda v, _: is_int(v) and v >= low, f"must be an integer >= {low}")


def one_of(choices: Iterable[Any]) -> Constraint:
    allowed = tuple(choices)
    return Constraint(lambda v, _: v in allowed, f"must be one of {list(allowed)}")


def optional(constraint: Constraint) -> Constraint:
    """`constraint`, or null (None)."""
    says = constraint.says
    if isinstance(says, str):
        says = says.replace("must be", "must be null or", 1)
    return dataclasses.replace(constraint, holds=lambda v, o: v is None or constraint.holds(v, o), says=says)


def at_least(other: str, label: str | None = None) -> Constraint:
    """Null, or at least the value of field `other` (`label`: its name in the message)."""
    name = label or other
    return Constraint(
        lambda v, o: v is None or v >= getattr(o, other), f"must be >= {name}={{{other}}}", (other,)
    )


def in_range(low: int, other: str) -> Constraint:
    """An integer in low..(field `other`)."""
    return Constraint(
        lambda v, o: is_int(v) and low <= v <= getattr(o, other),
        f"must be in {low}..{other}={{{other}}}",
        (other,),
    )


def divides(other: str) -> Constraint:
    """A positive integer that divides field `other`."""
    return Constraint(
        lambda v, o: is_int(v) and v >= 1 and getattr(o, other) % v == 0,
        f"must divide {other}={{{other}}}",
        (other,),
    )


def below(other: str, what: str = "an integer") -> Constraint:
    """Null, or an integer in 0..(field `other`)-1 (`what` it is, for the message)."""
    return Constraint(
        lambda v, o: v is None or (is_int(v) and 0 <= v < getattr(o, other)),
        f"must be null or {what} in 0..{other}-1",
        (other,),
    )


def check(holds: Callable[[Any, Any], bool], says: str | Callable[[Any, Any], str], *refs: str) -> Constraint:
    """A constraint of its own (a rule the vocabulary has no word for), reading fields `refs`."""
    return Constraint(holds, says, tuple(refs))
