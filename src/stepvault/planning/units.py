"""Parsing the quantities a plan is given on the command line: durations, sizes, prices.

Every parser raises :class:`PlanError` naming the option and an example of what it
accepts, so a typo never turns into a silently wrong plan.
"""

from __future__ import annotations

import math

from .. import _units as units
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
    """``"90s"``, ``"30m"``, ``"24h"``, ``"7d"``, ``"2w"``, ``"5y"`` or plain seconds -> seconds
    (:func:`stepvault._units.parse_duration`), > 0 unless ``zero_ok``."""
    if not isinstance(text, str):
        return positive(option, text, zero_ok=zero_ok)
    try:
        seconds = units.parse_duration(option, text)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return positive(option, seconds, zero_ok=zero_ok)


def parse_size(option: str, text: str | int) -> int:
    """``"14GB"`` (10^9), ``"1.5GiB"`` (2^30), ``"300MB"`` or plain bytes -> bytes (> 0)
    (:func:`stepvault._units.parse_size`)."""
    if not isinstance(text, str):
        return int(positive(option, text))
    try:
        size = units.parse_size(option, text)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return int(positive(option, size))


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
    return tier, dollars * 10**9 / units.SIZE_UNITS[unit]  # normalised to 10^9-byte GB
