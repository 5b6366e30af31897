"""Parsing the quantities a plan is given on the command line: durations, sizes, prices.

Every parser raises :class:`PlanError` naming the option and an example of what it
accepts, so a typo never turns into a silently wrong plan.
"""

from __future__ import annotations

import math
import re

from ..errors import PlanError

__all__ = [
    "HOURS_PER_MONTH",
    "PlanError",
    "parse_duration",
    "parse_price",
    "parse_size",
    "positive",
]

#: A billing month as the large clouds count it (730 h = 8760 h / 12).
HOURS_PER_MONTH = 730.0

_DURATION_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 7 * 86400.0,
    "y": 365 * 86400.0,
}
_SIZE_UNITS = {
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
_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def positive(option: str, value: float, *, zero_ok: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``zero_ok``), else a PlanError naming
    ``option``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{option} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        need = "non-negative" if zero_ok else "positive"
        raise PlanError(f"{option} must be a {need} finite number, got {value!r}")
    return number


def parse_duration(option: str, text: str | float, *, zero_ok: bool = False) -> float:
    """``"90s"``, ``"30m"``, ``"24h"``, ``"7d"``, ``"2w"``, ``"5y"`` or plain seconds -> seconds."""
    if not isinstance(text, str):
        return positive(option, text, zero_ok=zero_ok)
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if match is None or match.group(2) not in ("", *_DURATION_UNITS):
        raise PlanError(f"{option}: bad duration {text!r}; use e.g. 90s, 30m, 24h, 7d, 5y")
    seconds = float(match.group(1)) * _DURATION_UNITS.get(match.group(2), 1.0)
    return positive(option, seconds, zero_ok=zero_ok)


def parse_size(option: str, text: str | int) -> int:
    """``"14GB"`` (10^9), ``"1.5GiB"`` (2^30), ``"300MB"`` or plain bytes -> bytes (> 0)."""
    if not isinstance(text, str):
        return int(positive(option, text))
    match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise PlanError(f"{option}: bad size {text!r}; use e.g. 300MB, 14GB, 1.5GiB or bytes")
    return int(positive(option, float(match.group(1)) * _SIZE_UNITS[match.group(2)]))


def parse_price(text: str) -> tuple[str, float]:
    """``"hot=0.10/GB-month"`` -> ``("hot", 0.10)``: the tier and its dollars per GB-month.

    Units: ``/GB-month`` (10^9 bytes), ``/GiB-month`` (2^30), ``/TB-month``, ``/TiB-month``;
    a bare number means per GB-month (bills integrate over hours, a month being
    :data:`HOURS_PER_MONTH` hours). A price may
    be 0 (storage already paid for) but not negative.
    """
    tier, sep, value = text.partition("=")
    tier = tier.strip()
    if not sep or not tier:
        raise PlanError(f"--price {text!r}: write TIER=PRICE, e.g. hot=0.10/GB-month")
    amount, slash, unit = value.strip().partition("/")
    unit = unit.strip().lower().removesuffix("-month").removesuffix("/month") if slash else "gb"
    if unit not in ("gb", "gib", "tb", "tib"):
        raise PlanError(
            f"--price {text!r}: unknown unit {value!r}; use e.g. 0.10/GB-month, 23/TB-month"
        )
    try:
        dollars = float(amount.strip().lstrip("$"))
    except ValueError:
        raise PlanError(f"--price {text!r}: {amount!r} is not a number") from None
    dollars = positive(f"--price {tier}", dollars, zero_ok=True)
    return tier, dollars * 10**9 / _SIZE_UNITS[unit]  # normalised to 10^9-byte GB
