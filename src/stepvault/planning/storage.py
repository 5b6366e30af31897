"""The storage forecast: which checkpoints each tier holds over a planned run, and the bill.

The real policy objects decide, in the order the manager applies them after each save:

1. retention: :func:`stepvault.policy.plan_retention` with the keep policy deletes from the
   hot tier what no rule keeps — except checkpoints the tier policy still wants copied to a
   cold tier (the manager asks the tier mover to hold those, see ``TierMover.hold``);
2. the tier mover's pass: :func:`stepvault.tiers.plan_tiers` with the tier policy copies
   what cold tiers should hold and evicts from hot what hot should not. Cold tiers are
   archives: nothing is ever deleted from them.

Assumed (and stated in every plan): the mover's pass finishes before the next save; age
rules (``MoveAfter``) act at the first save after a checkpoint comes of age; no metrics, so
``KeepBest`` keeps nothing the other rules would not; no pins.

Bytes: a tier's footprint is the bytes shared by all checkpoints (a checkpoint's stored
bytes minus its new bytes: frozen layers, unchanged tensors) once, plus each held
checkpoint's new bytes, times the tier's size factor (a cold tier that stores with the
float codec holds less). This is how content addressing dedups within a tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..policy import CheckpointRecord, KeepPolicy, plan_retention
from .schedule import Schedule
from .units import HOURS_PER_MONTH

__all__ = ["StorageForecast", "TierUsage", "forecast_storage"]

HOT = "hot"


@dataclass
class TierUsage:
    tier: str
    steps: list[int]  # held at the end of the run
    bytes_end: int
    bytes_peak: int
    bytes_moved_in: int
    byte_hours: float  # integral of bytes held over the run
    price_per_gb_month: float | None

    @property
    def cost_run(self) -> float | None:
        if self.price_per_gb_month is None:
            return None
        return self.byte_hours / 1e9 / HOURS_PER_MONTH * self.price_per_gb_month

    @property
    def cost_month_after(self) -> float | None:
        if self.price_per_gb_month is None:
            return None
        return self.bytes_end / 1e9 * self.price_per_gb_month

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "checkpoints_end": len(self.steps),
            "steps_end": self.steps,
            "bytes_end": self.bytes_end,
            "bytes_peak": self.bytes_peak,
            "bytes_moved_in": self.bytes_moved_in,
            "gb_months": self.byte_hours / 1e9 / HOURS_PER_MONTH,
            "price_per_gb_month": self.price_per_gb_month,
            "cost_run": self.cost_run,
            "cost_per_month_after": self.cost_month_after,
        }


@dataclass
class StorageForecast:
    tiers: dict[str, TierUsage]
    #: (hours since start, {tier: bytes held}) after each save
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    deleted: int = 0
    evicted: int = 0
    assumptions: list[str] = field(default_factory=list)

    @property
    def cost_run(self) -> float | None:
        costs = [t.cost_run for t in self.tiers.values()]
        return None if any(c is None for c in costs) else sum(c or 0.0 for c in costs)

    def to_json(self) -> dict[str, Any]:
        return {
            "tiers": {name: t.to_json() for name, t in self.tiers.items()},
            "cost_run": self.cost_run,
            "deleted_from_hot": self.deleted,
            "evicted_from_hot": self.evicted,
            "timeline": [{"hours": h, "bytes": b} for h, b in _thinned(self.timeline)],
            "assumptions": list(self.assumptions),
        }


def forecast_storage(
    schedule: Schedule,
    *,
    sizes: Mapping[str, tuple[int, int]],
    keep: KeepPolicy | None = None,
    tiers: Any = None,
    prices: Mapping[str, float] | None = None,
    size_factors: Mapping[str, float] | None = None,
    start: float = 0.0,
) -> StorageForecast:
    """Apply ``keep`` and the tier policy ``tiers`` after every save of ``schedule``.

    ``sizes``: kind -> (stored bytes, new bytes) per checkpoint (a kind missing falls back
    to ``"full"``); ``prices``: tier -> dollars per GB-month; ``size_factors``: tier ->
    bytes there per byte in hot (default 1); ``start``: Unix time of the run's first step
    (checkpoint ``created`` times, which time- and age-based rules read, count from it).
    """
    from ..tiers import plan_tiers  # the tier layer, only when a tier policy is planned

    prices = dict(prices or {})
    factors = dict(size_factors or {})
    sizes = dict(sizes)
    cold = sorted(tiers.tiers()) if tiers is not None else []
    names = [HOT, *cold]
    kinds: dict[int, str] = {}
    records: list[CheckpointRecord] = []
    moved = dict.fromkeys(names, 0)
    peak = dict.fromkeys(names, 0)
    byte_hours = dict.fromkeys(names, 0.0)
    timeline: list[tuple[float, dict[str, int]]] = []
    deleted = evicted = 0
    current = dict.fromkeys(names, 0)
    last_hours = 0.0

    def size_of(step: int) -> tuple[int, int]:
        return sizes.get(kinds[step]) or sizes["full"]

    held = {n: _Held(size_of, factors.get(n, 1.0)) for n in names}

    for point in schedule.points:
        hours = point.wall / 3600.0
        for n in names:  # the bytes held since the previous save, for the bill
            byte_hours[n] += current[n] * (hours - last_hours)
        last_hours = hours
        now = start + point.wall
        kinds[point.step] = point.kind
        records.append(CheckpointRecord(point.step, now, kind=point.kind))
        held[HOT].add(point.step)
        before = {n: held[n].bytes for n in cold}

        # 1. retention, as CheckpointManager._apply_retention does it
        if keep is not None:
            plan = plan_retention(records, keep, now=now)
            delete = plan.delete
            if tiers is not None and delete:  # TierMover.hold: owed to a cold tier stays
                placement = tiers.place(records, now, {t: held[t].steps for t in cold})
                owed = {
                    s
                    for t, want in placement.cold.items()
                    for s in delete
                    if s in want and s not in held[t].steps
                }
                delete = [s for s in delete if s not in owed]
            gone = set(delete)
            records = [r for r in records if r.step not in gone]
            for step in gone:
                held[HOT].discard(step)
            deleted += len(gone)

        # 2. the tier mover's pass, as apply_tier_policy does it
        if tiers is not None:
            holdings = {t: held[t].steps for t in cold}  # read only by plan_tiers
            tplan = plan_tiers(records, tiers, now=now, holdings=holdings)
            for step, tier in tplan.copies:
                held[tier].add(step)
            out = set(tplan.evictions)
            records = [r for r in records if r.step not in out]
            for step in out:
                held[HOT].discard(step)
            evicted += len(out)
            for t in cold:
                moved[t] += held[t].bytes - before[t]

        for n in names:
            current[n] = held[n].bytes
            peak[n] = max(peak[n], current[n])
        timeline.append((hours, dict(current)))

    end_hours = (
        schedule.total_steps * schedule.step_time + schedule.save_cost * len(schedule.points)
    ) / 3600.0
    for n in names:
        byte_hours[n] += current[n] * max(0.0, end_hours - last_hours)
    moved[HOT] = sum(size_of(p.step)[1] for p in schedule.points)  # written by the saves
    if schedule.points:
        moved[HOT] += size_of(schedule.points[0].step)[0] - size_of(schedule.points[0].step)[1]
    usage = {
        n: TierUsage(
            n,
            sorted(held[n].steps),
            current[n],
            peak[n],
            moved[n],
            byte_hours[n],
            prices.get(n),
        )
        for n in names
    }
    notes = [
        "the tier mover's pass finishes before the next save; age rules act at the next save",
        "no metrics are simulated: KeepBest keeps nothing the other rules do not; no pins",
        "bytes per tier: shared bytes (stored - new) once + new bytes per held checkpoint",
    ]
    missing = [n for n in names if n not in prices]
    if missing:
        notes.append(
            f"no price for tier(s) {', '.join(missing)}: give --price "
            f"{missing[0]}=0.02/GB-month to include it in the bill"
        )
    return StorageForecast(usage, timeline, deleted, evicted, notes)


#: A plan's JSON (and figure) carries at most this many points of the timeline.
TIMELINE_POINTS = 500


def _thinned(timeline: list[Any]) -> list[Any]:
    """Every k-th point and the last, so a run of 100k saves gives a readable document."""
    if len(timeline) <= TIMELINE_POINTS:
        return list(timeline)
    k = -(-len(timeline) // TIMELINE_POINTS)
    return [*timeline[:-1:k], timeline[-1]]


class _Held:
    """The steps one tier holds, with their footprint kept up to date as steps come and go
    (recomputing it from scratch after every save would make a long plan quadratic)."""

    def __init__(self, size_of: Any, factor: float) -> None:
        self.steps: set[int] = set()
        self._size_of = size_of
        self._factor = factor
        self._new = 0
        self._shared: dict[int, int] = {}  # shared bytes -> how many held steps have them

    def add(self, step: int) -> None:
        if step in self.steps:
            return
        stored, new = self._size_of(step)
        self.steps.add(step)
        self._new += new
        self._shared[stored - new] = self._shared.get(stored - new, 0) + 1

    def discard(self, step: int) -> None:
        if step not in self.steps:
            return
        stored, new = self._size_of(step)
        self.steps.remove(step)
        self._new -= new
        left = self._shared[stored - new] - 1
        if left:
            self._shared[stored - new] = left
        else:
            del self._shared[stored - new]

    @property
    def bytes(self) -> int:
        if not self.steps:
            return 0
        return int(self._factor * (max(self._shared) + self._new))
