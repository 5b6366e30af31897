"""Keep policies: which committed checkpoints survive, and why.

A keep rule maps records to ``step -> reason``; rules compose with ``|`` (union), and
:func:`plan_retention` turns a rule into a :class:`RetentionPlan` that names every rule
keeping each survivor, so a retention change can be printed and dry-run before anything
is deleted::

    policy = KeepLast(3) | KeepBest(2, "val_loss") | KeepPeriodic(timedelta(days=1))
    print(plan_retention(records, policy, now=time.time()))

Rules only ever keep *valid* checkpoints (``valid=False`` means known damaged, and a
damaged checkpoint is worth nothing to resume from or to deploy); only a pin
(:class:`KeepPinned`, and the pin invariant of :func:`plan_retention`) keeps a damaged one,
for forensics. Rules are pure functions of their configuration and inputs: no state, so
the same records and ``now`` always give the same plan.

(At ~400 lines: the keep rules and plan_retention, which applies them with the
invariants, belong together.)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Literal

from .base import (
    CheckpointRecord,
    KeepAny,
    KeepPolicy,
    RetentionEntry,
    RetentionPlan,
    _Rule,
    tracked_metrics,
)
from .validate import exactly_one, num, positive_int, positive_seconds

__all__ = [
    "DAMAGED_REASON",
    "NEWEST_REASON",
    "NO_POLICY_REASON",
    "NO_RULE_REASON",
    "PINNED_REASON",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPeriodic",
    "KeepPinned",
    "KeepWithin",
    "plan_retention",
    "tracked_metrics",
]

Mode = Literal["min", "max"]

PINNED_REASON = "pinned"
NEWEST_REASON = "newest valid checkpoint (needed to resume)"
NO_POLICY_REASON = "no keep policy"
NO_RULE_REASON = "no rule keeps it"
DAMAGED_REASON = "damaged (valid=False) and not pinned"


# --------------------------------------------------------------------------- helpers


_UNITS: tuple[tuple[str, float], ...] = (
    ("day", 86400.0),
    ("hour", 3600.0),
    ("minute", 60.0),
    ("second", 1.0),
)


def _duration(seconds: float) -> str:
    """``86400`` -> ``"1 day"``, ``5400`` -> ``"90 minutes"``: the largest exact unit."""
    for unit, size in _UNITS:
        count = seconds / size
        if count >= 1 and count.is_integer():
            return f"{int(count)} {unit}" + ("" if count == 1 else "s")
    return f"{num(seconds)} seconds"


def _timedelta_repr(seconds: float) -> str:
    return repr(timedelta(seconds=seconds)).removeprefix("datetime.")


def _metric(record: CheckpointRecord, metric: str) -> float | None:
    """The record's finite value of ``metric``, or None when it has none."""
    value = record.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _ranked_by_metric(
    records: Iterable[CheckpointRecord], metric: str, mode: str
) -> list[CheckpointRecord]:
    """Valid records that carry ``metric``, best first; ties go to the newer step (its
    optimizer and data-loader state are the later ones, and it is what a user who
    watched the curve would pick)."""
    scored = [(v, r) for r in records if r.valid and (v := _metric(r, metric)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda item: (sign * item[0], -item[1].step))
    return [r for _, r in scored]


# --------------------------------------------------------------------------- rules


class KeepLast(_Rule):
    """Keep the ``n`` newest (highest step) valid checkpoints.

    With ``kind`` (``"full"`` or ``"weights"``) only checkpoints of that kind count and
    are kept, e.g. ``KeepLast(2, kind="full") | KeepLast(10, kind="weights")``.
    """

    def __init__(self, n: int, *, kind: str | None = None) -> None:
        self._n = positive_int("KeepLast(n)", n)
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"kind= must be a string or None, got {kind!r}")
        self._kind = kind

    @property
    def n(self) -> int:
        return self._n

    @property
    def kind(self) -> str | None:
        return self._kind

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        counted = [r for r in records if r.valid and (self._kind is None or r.kind == self._kind)]
        newest = sorted(counted, key=lambda r: r.step)[-self._n :]
        reason = f"last {self._n}" + ("" if self._kind is None else f" {self._kind}")
        return {r.step: reason for r in newest}

    def _key(self) -> tuple[object, ...]:
        return (self._n, self._kind)

    def __repr__(self) -> str:
        kind = "" if self._kind is None else f", kind={self._kind!r}"
        return f"KeepLast({self._n}{kind})"


class KeepBest(_Rule):
    """Keep the ``n`` best valid checkpoints by ``metrics[metric]`` (lowest for
    ``mode="min"``, highest for ``"max"``); ties go to the newer step.

    A checkpoint without the metric (or with a NaN/infinite value) is neither best nor
    worst: this rule neither counts nor keeps it, and other rules decide its fate. So a
    run that logs ``val_loss`` only every few saves keeps its ``n`` best *evaluated*
    checkpoints, not fewer.
    """

    def __init__(self, n: int, metric: str, mode: Mode = "min") -> None:
        self._n = positive_int("KeepBest(n)", n)
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"KeepBest metric must be a non-empty string, got {metric!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode= must be 'min' or 'max', got {mode!r}")
        self._metric = metric
        self._mode: str = mode

    @property
    def n(self) -> int:
        return self._n

    @property
    def metric(self) -> str:
        return self._metric

    @property
    def mode(self) -> str:
        return self._mode

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        best = _ranked_by_metric(records, self._metric, self._mode)[: self._n]
        reason = f"best {self._n} by {self._metric} ({self._mode})"
        return {r.step: reason for r in best}

    def tracked_metrics(self) -> tuple[tuple[str, str], ...]:
        return ((self._metric, self._mode),)

    def _key(self) -> tuple[object, ...]:
        return (self._n, self._metric, self._mode)

    def __repr__(self) -> str:
        return f"KeepBest({self._n}, {self._metric!r}, mode={self._mode!r})"


class KeepEvery(_Rule):
    """Keep valid checkpoints whose step is a multiple of ``steps`` (a sparse trail
    through the whole run, e.g. for later analysis of training dynamics)."""

    def __init__(self, *, steps: int) -> None:
        self._steps = positive_int("KeepEvery(steps=)", steps)

    @property
    def steps(self) -> int:
        return self._steps

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        plural = "" if self._steps == 1 else "s"
        reason = f"every {self._steps} step{plural}"
        return {r.step: reason for r in records if r.valid and r.step % self._steps == 0}

    def _key(self) -> tuple[object, ...]:
        return (self._steps,)

    def __repr__(self) -> str:
        return f"KeepEvery(steps={self._steps})"


class KeepWithin(_Rule):
    """Keep every valid checkpoint created within a window before ``now``
    (``created >= now - window``). Give exactly one of ``seconds``, ``minutes``,
    ``hours``, ``days``. With ``kind`` only checkpoints of that kind are kept, e.g.
    ``KeepWithin(days=7, kind="light")`` expires light checkpoints after a week."""

    def __init__(
        self,
        *,
        seconds: float | None = None,
        minutes: float | None = None,
        hours: float | None = None,
        days: float | None = None,
        kind: str | None = None,
    ) -> None:
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"kind= must be a string or None, got {kind!r}")
        self._kind = kind
        given = exactly_one(seconds=seconds, minutes=minutes, hours=hours, days=days)
        if len(given) != 1:
            got = ", ".join(f"{k}=" for k in given) if given else "none"
            raise ValueError(
                f"KeepWithin() takes exactly one of seconds=, minutes=, hours=, days= (got {got})"
            )
        ((unit, value),) = given.items()
        scale = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}[unit]
        self._unit = unit
        self._value = positive_seconds(f"KeepWithin({unit}=)", value)
        self._window = self._value * scale

    @property
    def window_seconds(self) -> float:
        return self._window

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        cutoff = now - self._window
        plural = "" if self._value == 1 else "s"
        reason = f"within {num(self._value)} {self._unit[:-1]}{plural}"
        if self._kind is not None:
            reason += f" {self._kind}"
        return {
            r.step: reason
            for r in records
            if r.valid and r.created >= cutoff and (self._kind is None or r.kind == self._kind)
        }

    def _key(self) -> tuple[object, ...]:
        return (self._window, self._kind)

    def __repr__(self) -> str:
        kind = "" if self._kind is None else f", kind={self._kind!r}"
        return f"KeepWithin({self._unit}={num(self._value)}{kind})"


class KeepPeriodic(_Rule):
    """Keep one checkpoint per period: the newest valid one in each ``every``-long
    bucket, for buckets within ``within`` of now (None: forever).

    Buckets are ``floor(created / every)`` on Unix time, so daily buckets start at
    midnight UTC and do not shift as ``now`` advances: the checkpoint kept for a day stays
    the one kept (a rolling window would delete and re-pick every time). Only records
    with ``created >= now - within`` are considered. E.g.
    ``KeepPeriodic(timedelta(days=1), within=timedelta(days=30))`` keeps a daily
    checkpoint for the last 30 days. ``every`` and ``within`` may also be given in seconds.
    """

    def __init__(self, every: timedelta | float, within: timedelta | float | None = None) -> None:
        self._every = positive_seconds("KeepPeriodic(every=)", every)
        self._within = None if within is None else positive_seconds("KeepPeriodic(within=)", within)

    @property
    def every_seconds(self) -> float:
        return self._every

    @property
    def within_seconds(self) -> float | None:
        return self._within

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        cutoff = -math.inf if self._within is None else now - self._within
        newest: dict[int, CheckpointRecord] = {}
        for record in records:
            if not record.valid or record.created < cutoff:
                continue
            bucket = math.floor(record.created / self._every)
            held = newest.get(bucket)
            if held is None or (record.created, record.step) > (held.created, held.step):
                newest[bucket] = record
        reason = f"one per {_duration(self._every)}"
        if self._within is not None:
            reason += f" for {_duration(self._within)}"
        return {r.step: reason for r in sorted(newest.values(), key=lambda r: r.step)}

    def _key(self) -> tuple[object, ...]:
        return (self._every, self._within)

    def __repr__(self) -> str:
        within = "" if self._within is None else f", within={_timedelta_repr(self._within)}"
        return f"KeepPeriodic({_timedelta_repr(self._every)}{within})"


class KeepPinned(_Rule):
    """Keep pinned checkpoints, damaged or not (a pin is an explicit human decision)."""

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        return {r.step: PINNED_REASON for r in records if r.pinned}

    def _key(self) -> tuple[object, ...]:
        return ()

    def __repr__(self) -> str:
        return "KeepPinned()"


# --------------------------------------------------------------------------- planning


def _best_label(metric: str, mode: str, ambiguous: set[str]) -> str:
    # The mode only matters to the reader when the same metric is ranked both ways.
    suffix = f" ({mode})" if metric in ambiguous else ""
    return f"current best by {metric}{suffix}"


def plan_retention(
    records: Iterable[CheckpointRecord],
    policy: KeepPolicy | None,
    *,
    now: float,
    best_metrics: Iterable[tuple[str, str]] | None = None,
) -> RetentionPlan:
    """Decide which checkpoints to keep and say why, one entry per record, by step.

    A record is kept when ``policy`` selects it, and in any case (whatever the policy
    says, so that no configuration can lose them) when it is:

    * pinned (``"pinned"``; this keeps even a damaged record),
    * the newest valid checkpoint of kind ``"full"``
      (``"newest valid checkpoint (needed to resume)"``),
    * the base of a kept light checkpoint (``"base of light @N"``: a light checkpoint is a
      delta against it and unusable without it),
    * the best valid checkpoint by one of ``best_metrics``, ``(metric, mode)`` pairs
      (``"current best by val_loss"``). ``None`` (the default) means the pairs of every
      :class:`KeepBest` inside ``policy``, see :func:`tracked_metrics`.

    Damaged records (``valid=False``) are never kept by these invariants except the pin.
    ``policy=None`` keeps everything (``"no keep policy"``). Each entry lists every reason
    that keeps it; a deleted entry says why nothing does. ``now`` is Unix time, the clock
    of :attr:`CheckpointRecord.created`.
    """
    ordered = sorted(records, key=lambda r: r.step)
    steps = [r.step for r in ordered]
    if len(set(steps)) != len(steps):
        dupes = sorted({s for s in steps if steps.count(s) > 1})
        raise ValueError(f"plan_retention: duplicate checkpoint steps {dupes}")
    if best_metrics is None:
        pairs = tracked_metrics(policy)
    else:
        pairs = tuple(dict.fromkeys((str(m), str(mode)) for m, mode in best_metrics))
    for metric, mode in pairs:
        if mode not in ("min", "max"):
            raise ValueError(f"best_metrics mode for {metric!r} must be 'min' or 'max'")

    reasons: dict[int, list[str]] = {s: [] for s in steps}

    def add(step: int, reason: str) -> None:
        if reason and reason not in reasons[step]:
            reasons[step].append(reason)

    if policy is None:
        for step in steps:
            add(step, NO_POLICY_REASON)
    else:
        # A copy, so a rule that sorts or filters in place cannot disturb the others.
        for step, reason in policy.select(list(ordered), now).items():
            if step in reasons:
                for part in reason.split("; "):
                    add(step, part)

    for record in ordered:
        if record.pinned:
            add(record.step, PINNED_REASON)

    newest_full = [r for r in ordered if r.valid and r.kind == "full"]
    if newest_full:
        add(newest_full[-1].step, NEWEST_REASON)

    modes_of: dict[str, set[str]] = {}
    for metric, mode in pairs:
        modes_of.setdefault(metric, set()).add(mode)
    ambiguous = {m for m, modes in modes_of.items() if len(modes) > 1}
    for metric, mode in pairs:
        ranked = _ranked_by_metric(ordered, metric, mode)
        if ranked:
            add(ranked[0].step, _best_label(metric, mode, ambiguous))

    _keep_light_bases(ordered, reasons, add)

    entries = []
    for record in ordered:
        kept = reasons[record.step]
        if kept:
            entries.append(RetentionEntry(record.step, True, list(kept)))
        else:
            why = NO_RULE_REASON if record.valid else DAMAGED_REASON
            entries.append(RetentionEntry(record.step, False, [why]))
    return RetentionPlan(entries)


def _keep_light_bases(
    ordered: list[CheckpointRecord],
    reasons: dict[int, list[str]],
    add: Callable[[int, str], None],
) -> None:
    """Keep the valid base of every kept light checkpoint, naming the newest that needs it
    (and how many more do): last, so that every other reason has been decided."""
    valid = {r.step for r in ordered if r.valid}
    needing: dict[int, list[int]] = {}
    for record in ordered:
        base = record.base_step
        if record.kind == "light" and reasons[record.step] and base in valid:
            needing.setdefault(base, []).append(record.step)
    for base, lights in needing.items():
        more = f" and {len(lights) - 1} more" if len(lights) > 1 else ""
        add(base, f"base of light @{lights[-1]}{more}")
