"""Quantities as people write them: sizes, durations, byte counts and times, parsed and
printed in one place (a leaf module: every layer may import it; it imports nothing of
stepvault and no torch).

Sizes: ``"8GB"`` (10^9), ``"512MiB"`` (2^20), ``"1.5 GB"``, ``"300mb"`` or bytes.
Durations: ``"90s"``, ``"30m"``/``"30min"``, ``"12h"``, ``"7d"``, ``"2w"``, ``"5y"`` or
seconds. Both raise :class:`ValueError` naming the option and what it accepts; callers
with an error type of their own (``PlanError``, a CLI usage error) convert it.
"""

from __future__ import annotations

import datetime as _dt
import math
import re

__all__ = ["format_time", "human_bytes", "parse_duration", "parse_size"]

_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_QUANTITY = re.compile(_NUMBER + r"\s*([a-z]*)")

SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
DURATION_UNITS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 7 * 86400.0,
    "y": 365 * 86400.0,
}


def _quantity(text: str, units: dict[str, float] | dict[str, int]) -> float | None:
    """``number * unit`` of ``text``, or None when it is not one (or not finite)."""
    m = _QUANTITY.fullmatch(text.strip().lower())
    if m is None or m.group(2) not in units:
        return None
    value = float(m.group(1)) * units[m.group(2)]
    return value if math.isfinite(value) else None


def parse_size(option: str, value: object) -> int:
    """Bytes from an int (>= 0) or a size such as ``"8GB"``, ``"512MiB"``, ``"1.5 GB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    number = _quantity(value, SIZE_UNITS) if isinstance(value, str) else None
    if number is None or number < 0:
        raise ValueError(
            f"{option} must be a number of bytes or a size such as '8GB', '512MiB' or "
            f"'1.5GiB' (not negative), got {value!r}"
        )
    return int(number)


def parse_duration(option: str, value: object) -> float:
    """Seconds (>= 0) from a number or a duration such as ``"90s"``, ``"30m"``, ``"12h"``,
    ``"7d"``, ``"2w"``, ``"5y"`` (a bare number is seconds)."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if math.isfinite(value) else None
    elif isinstance(value, str):
        number = _quantity(value, DURATION_UNITS)
    if number is not None and number < 0:
        raise ValueError(f"{option} must not be negative, got {value!r}")
    if number is None:
        raise ValueError(
            f"{option}: bad duration {value!r}; use e.g. 90s, 30m, 12h, 7d, 2w (or seconds)"
        )
    return number


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, as ``du -h``); None -> ``''``."""
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_time(ts: float | None, missing: str = "?") -> str:
    """A POSIX time as local ``YYYY-MM-DD HH:MM:SS``; ``missing`` for None or 0."""
    if not ts:
        return missing
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
