"""Numeric arguments of policies: one set of checks, and how numbers print back.

Save, keep and tier rules all take counts, intervals and durations. They are checked here,
once, so a rule cannot accept ``True`` as "1", a NaN interval or a negative age that its
neighbour refuses. ``name`` is the argument as the user wrote it (``"KeepLast(n)"``,
``"steps="``): every message starts with it and says what a valid value looks like.
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from typing import TypeGuard

__all__ = [
    "exactly_one",
    "non_negative_real",
    "num",
    "positive_int",
    "positive_real",
    "positive_seconds",
    "seconds_in",
]


def _is_real(value: object) -> TypeGuard[numbers.Real]:
    # bool is an int subclass; Every(steps=True) is a bug, not "every step".
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """``value`` as an int when it is an integer > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def positive_real(name: str, value: object) -> float:
    """``value`` as a float when it is a finite number > 0 (not a bool)."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return number


def non_negative_real(name: str, value: object) -> float:
    """``value`` as a float when it is a finite number >= 0 (not a bool)."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def _to_seconds(value: object, scale: float) -> float | None:
    """Seconds in a timedelta, or in a plain number of ``scale``-second units; None when
    ``value`` is neither."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if _is_real(value):
        return float(value) * scale
    return None


def positive_seconds(name: str, value: object) -> float:
    """A positive duration given as a timedelta or a number of seconds."""
    seconds = _to_seconds(value, 1.0)
    if seconds is None:
        raise ValueError(f"{name} must be a timedelta or seconds, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive duration, got {value!r}")
    return seconds


def seconds_in(name: str, unit: str, value: object, scale: float) -> float:
    """A duration >= 0 in seconds: a timedelta, or a number of ``unit`` (``scale`` seconds
    each). ``name`` is the rule, ``unit`` the keyword it was given as."""
    seconds = _to_seconds(value, scale)
    if seconds is None:
        raise ValueError(f"{name}: {unit}= must be a number or timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name}: {unit}= must be a non-negative duration, got {value!r}")
    return seconds


def exactly_one(**options: object) -> dict[str, object]:
    """The options that were given (not None), in keyword order. Callers raise their own
    error, which names the rule, when this is not exactly one."""
    return {name: value for name, value in options.items() if value is not None}


def num(value: float) -> str:
    """A number as people write it: ``1000``, ``0.5``, ``30`` (not ``30.0``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)
