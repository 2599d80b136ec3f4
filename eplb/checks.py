"""The scalar rules of eplb's options and of the wire's, each defined once.

Each check returns the value (a number as a plain ``int`` or ``float``) or raises ``ValueError`` saying
``{name} must be {what is allowed}, got {value!r}``. The allowed text is built from the rule
(``an integer >= 0``, ``a finite number > 0``, ...), then ``what`` the value counts in
parentheses, then ``or None (none)`` where the caller takes None (``none``: what None means; ""
for nothing to say). ``allowed`` replaces the whole text where a message words the same rule
its own way. A bool is never a number here: ``True`` as a count is always a caller's bug.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NoReturn, TypeGuard

__all__ = ["is_int", "is_number", "nonneg_int", "nonneg_number", "one_of", "positive_int", "positive_number"]


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[numbers.Real]:
    """A real number (Python's or numpy's integers and floats), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _refuse(name: str, rule: str, what: str, none: str | None, allowed: str | None, value: object) -> NoReturn:
    if allowed is None:
        allowed = rule + (f" ({what})" if what else "")
        if none is not None:
            allowed += f" or None ({none})" if none else " or None"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def nonneg_int(name: str, value: object, what: str = "", *, none: str | None = None, allowed: str | None = None) -> int:
    """``value`` as an ``int`` if it is an integer >= 0."""
    if is_int(value) and int(value) >= 0:
        return int(value)
    _refuse(name, "an integer >= 0", what, none, allowed, value)


def positive_int(
    name: str, value: object, what: str = "", *, none: str | None = None, allowed: str | None = None
) -> int:
    """``value`` as an ``int`` if it is an integer >= 1."""
    if is_int(value) and int(value) >= 1:
        return int(value)
    _refuse(name, "an integer >= 1", what, none, allowed, value)


def nonneg_number(
    name: str,
    value: object,
    what: str = "",
    *,
    finite: bool = False,
    none: str | None = None,
    allowed: str | None = None,
) -> float:
    """``value`` as a ``float`` if it is a number >= 0 (NaN never is); ``finite``: not infinity either."""
    if is_number(value) and float(value) >= 0 and not (finite and math.isinf(value)):
        return float(value)
    _refuse(name, "a finite number >= 0" if finite else "a number >= 0", what, none, allowed, value)


def positive_number(
    name: str,
    value: object,
    what: str = "",
    *,
    finite: bool = False,
    none: str | None = None,
    allowed: str | None = None,
) -> float:
    """``value`` as a ``float`` if it is a number > 0 (NaN never is); ``finite``: not infinity either."""
    if is_number(value) and float(value) > 0 and not (finite and math.isinf(value)):
        return float(value)
    _refuse(name, "a finite number > 0" if finite else "a number > 0", what, none, allowed, value)


def one_of(name: str, value: object, choices: Sequence[str], *, none: str | None = None) -> str:
    """``value`` if it is one of ``choices`` (names: ``effort``'s levels, ...)."""
    if isinstance(value, str) and value in choices:
        return value
    _refuse(name, f"one of {', '.join(map(repr, choices))}", "", none, None, value)
