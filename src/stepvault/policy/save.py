"""Save policies: when to write a checkpoint.

Each rule is a small object that prints as the expression that built it, composes with
``|`` and is driven by synthetic :class:`SaveContext` values in tests, so a schedule can be
read, tested and dry-run without a training loop::

    policy = Every(steps=1000) | Every(minutes=30) | OnSignal()
    print(policy)   # Every(steps=1000) | Every(minutes=30) | OnSignal(SIGTERM, SIGUSR1)

The manager calls :meth:`SavePolicy.decide` at every step boundary, starts a save when it
gets a :class:`SaveDecision`, and then calls :meth:`SavePolicy.saved` so stateful rules
re-arm. :class:`OnSignal` (preemption) lives in :mod:`.signals` and is re-exported here.
Configuration is read-only after construction (properties without setters); the
only mutable parts are the timers and flags a rule needs to remember what it has seen.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

from .base import AnyOf, SaveContext, SaveDecision, SavePolicy, merge_decisions
from .signals import OnSignal
from .validate import exactly_one, non_negative_real, num, positive_int, positive_real

__all__ = [
    "AnyOf",
    "AtSteps",
    "Every",
    "FirstStep",
    "LastStep",
    "OnSignal",
    "YoungDaly",
    "merge_decisions",
]

SaveKind = Literal["full", "weights", "light"]
_KINDS: tuple[str, ...] = ("full", "weights", "light")


# --------------------------------------------------------------------------- helpers


def _check_kind(what: str) -> str:
    if what not in _KINDS:
        raise ValueError(f"what= must be 'full', 'weights' or 'light', got {what!r}")
    return what


def _plural(value: float, unit: str) -> str:
    return f"{num(value)} {unit}" + ("" if value == 1 else "s")


def _kind_suffix(what: str) -> str:
    return "" if what == "full" else f", what={what!r}"


# --------------------------------------------------------------------------- intervals


class _Timer:
    """Wall-clock re-arming shared by the time-based rules.

    The anchor is the time of the last save this rule heard of (its own firing or any
    save reported through ``saved``), or the first step boundary it saw. Anchoring on the
    first call, not on 0, means a resumed run does not save on its first step just
    because monotonic time is large.
    """

    __slots__ = ("anchor",)

    def __init__(self) -> None:
        self.anchor: float | None = None

    def due(self, now: float, interval: float) -> bool:
        if self.anchor is None:
            self.anchor = now
            return False
        if now - self.anchor >= interval:
            self.anchor = now
            return True
        return False

    def rearm(self, now: float) -> None:
        self.anchor = now


_TIME_UNITS: dict[str, float] = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}


class Every(SavePolicy):
    """Save at a regular interval of steps, epochs or wall-clock time.

    Give exactly one of:

    * ``steps=N``: at every step that is a multiple of N (step 0 excluded: there is
      nothing to save before the first step).
    * ``epochs=N``: at the first step boundary whose epoch is in a later multiple of N
      than the epoch at this rule's last firing (or at its first call); never while
      ``ctx.epoch`` is None. A resumed run at epoch 5 with ``epochs=2`` saves on entering
      epoch 6.
    * ``seconds=``, ``minutes=`` or ``hours=``: when ``ctx.now`` is at least the interval
      after the last save (any save: a step-triggered save also resets this timer, since
      what bounds lost work is the time since *a* checkpoint) or, before any save, after
      the first step boundary this rule saw.

    ``what`` is the kind of checkpoint: ``"full"`` (whole training state),
    ``"weights"`` (modules only) or ``"light"`` (lossy deltas against the newest full one,
    e.g. ``Every(steps=10, what="light") | Every(steps=1000)``).
    """

    def __init__(
        self,
        steps: int | None = None,
        epochs: int | None = None,
        seconds: float | None = None,
        minutes: float | None = None,
        hours: float | None = None,
        *,
        what: SaveKind = "full",
    ) -> None:
        given = exactly_one(
            steps=steps, epochs=epochs, seconds=seconds, minutes=minutes, hours=hours
        )
        if len(given) != 1:
            got = ", ".join(f"{k}=" for k in given) if given else "none"
            raise ValueError(
                "Every() takes exactly one interval: steps=, epochs=, seconds=, minutes= "
                f"or hours= (got {got}); combine rules with | instead, "
                "e.g. Every(steps=1000) | Every(minutes=30)"
            )
        ((unit, value),) = given.items()
        if unit in ("steps", "epochs"):
            self._value: float = positive_int(f"{unit}=", value)
        else:
            self._value = positive_real(f"{unit}=", value)
        self._unit = unit
        self._what = _check_kind(what)
        self._timer = _Timer()
        self._epoch_bucket: int | None = None

    @property
    def unit(self) -> str:
        """``"steps"``, ``"epochs"``, ``"seconds"``, ``"minutes"`` or ``"hours"``."""
        return self._unit

    @property
    def value(self) -> float:
        """The interval in :attr:`unit`."""
        return self._value

    @property
    def what(self) -> str:
        return self._what

    @property
    def interval_seconds(self) -> float | None:
        """The interval in seconds for time-based rules, None for steps/epochs."""
        scale = _TIME_UNITS.get(self._unit)
        return None if scale is None else self._value * scale

    def _reason(self) -> str:
        return f"every {_plural(self._value, self._unit[:-1])}"

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        if self._unit == "steps":
            fire = ctx.step > 0 and ctx.step % self._value == 0
        elif self._unit == "epochs":
            fire = self._epoch_due(ctx.epoch)
        else:
            interval = self.interval_seconds
            assert interval is not None
            fire = self._timer.due(ctx.now, interval)
        return SaveDecision(kind=self._what, reason=self._reason()) if fire else None

    def _epoch_due(self, epoch: int | None) -> bool:
        if epoch is None:
            return False
        bucket = epoch // int(self._value)
        if self._epoch_bucket is None or bucket < self._epoch_bucket:
            # First sight, or epochs went backwards (policy reused for another run):
            # take this as the baseline rather than firing.
            self._epoch_bucket = bucket
            return False
        if bucket > self._epoch_bucket:
            self._epoch_bucket = bucket
            return True
        return False

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        if self._unit in _TIME_UNITS:
            self._timer.rearm(ctx.now)

    def __repr__(self) -> str:
        return f"Every({self._unit}={num(self._value)}{_kind_suffix(self._what)})"


class AtSteps(SavePolicy):
    """Save at exactly the given steps, e.g. ``AtSteps(1000, 5000, 10000)``."""

    def __init__(self, *steps: int, what: SaveKind = "full") -> None:
        if not steps:
            raise ValueError("AtSteps() needs at least one step, e.g. AtSteps(1000, 5000)")
        checked: list[int] = []
        for step in steps:
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise ValueError(f"AtSteps() steps must be non-negative integers, got {step!r}")
            checked.append(int(step))
        self._steps: tuple[int, ...] = tuple(sorted(set(checked)))
        self._step_set = frozenset(self._steps)
        self._what = _check_kind(what)

    @property
    def steps(self) -> tuple[int, ...]:
        """The steps, sorted, without duplicates."""
        return self._steps

    @property
    def what(self) -> str:
        return self._what

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        if ctx.step in self._step_set:
            return SaveDecision(kind=self._what, reason=f"at step {ctx.step}")
        return None

    def __repr__(self) -> str:
        steps = ", ".join(str(s) for s in self._steps)
        return f"AtSteps({steps}{_kind_suffix(self._what)})"


class FirstStep(SavePolicy):
    """Save at the first step boundary of this process: a fresh start or right after a
    resume.

    Fires on the very first :meth:`decide` call of this instance, whatever the step. Useful
    to prove early that saving works (permissions, disk space, unencodable state) instead
    of finding out hours later, and to record the state a run actually started from.
    """

    def __init__(self, *, what: SaveKind = "full") -> None:
        self._what = _check_kind(what)
        self._seen = False

    @property
    def what(self) -> str:
        return self._what

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        if self._seen:
            return None
        self._seen = True
        return SaveDecision(kind=self._what, reason="first step of this process")

    def __repr__(self) -> str:
        return f"FirstStep({_kind_suffix(self._what)[2:]})"


class LastStep(SavePolicy):
    """Save when the run reaches its last step (``ctx.step >= ctx.total_steps``).

    Never fires while ``ctx.total_steps`` is None (length of the run unknown).
    """

    def __init__(self, *, what: SaveKind = "full") -> None:
        self._what = _check_kind(what)

    @property
    def what(self) -> str:
        return self._what

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        if ctx.total_steps is not None and ctx.step >= ctx.total_steps:
            return SaveDecision(kind=self._what, reason=f"last step ({ctx.total_steps})")
        return None

    def __repr__(self) -> str:
        return f"LastStep({_kind_suffix(self._what)[2:]})"


# --------------------------------------------------------------------------- Young/Daly


class YoungDaly(SavePolicy):
    """Save at the interval that minimises expected lost time, from the failure rate.

    Young's first-order optimum (also Daly's first-order term) is
    ``interval = sqrt(2 * C * MTBF)``, with C the cost of one save as training sees it
    (``ctx.save_cost``: the stall for async saves, so cheap async saves mean frequent
    checkpoints) and MTBF the mean time between failures of the whole job (for N nodes
    each with MTBF m, roughly m / N). E.g. C = 60 s, MTBF = 24 h gives ≈ 3220 s.

    The interval is clamped to ``[min_seconds, max_seconds]``. Until a save cost has been
    measured (``ctx.save_cost`` is None) the interval is ``min_seconds``: an early save is
    what measures the cost. Fires like ``Every(seconds=...)``: time since the last save
    (of any rule) or since the first step boundary seen.
    """

    def __init__(
        self,
        mtbf_hours: float,
        *,
        min_seconds: float = 60,
        max_seconds: float | None = None,
        what: SaveKind = "full",
    ) -> None:
        self._mtbf_hours = positive_real("mtbf_hours=", mtbf_hours)
        self._min_seconds = non_negative_real("min_seconds=", min_seconds)
        if max_seconds is not None:
            max_value = positive_real("max_seconds=", max_seconds)
            if max_value < self._min_seconds:
                raise ValueError(
                    f"max_seconds= ({max_seconds!r}) must be >= min_seconds= ({min_seconds!r})"
                )
            self._max_seconds: float | None = max_value
        else:
            self._max_seconds = None
        self._what = _check_kind(what)
        self._timer = _Timer()

    @property
    def mtbf_hours(self) -> float:
        return self._mtbf_hours

    @property
    def min_seconds(self) -> float:
        return self._min_seconds

    @property
    def max_seconds(self) -> float | None:
        return self._max_seconds

    @property
    def what(self) -> str:
        return self._what

    def interval(self, save_cost: float | None) -> float:
        """Seconds between saves for a save costing ``save_cost`` seconds (None: unknown)."""
        if save_cost is None or not math.isfinite(save_cost):
            return self._min_seconds
        optimum = math.sqrt(2.0 * max(save_cost, 0.0) * self._mtbf_hours * 3600.0)
        if self._max_seconds is not None:
            optimum = min(optimum, self._max_seconds)
        return max(optimum, self._min_seconds)

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        interval = self.interval(ctx.save_cost)
        if not self._timer.due(ctx.now, interval):
            return None
        if ctx.save_cost is None:
            cost = "save cost not measured yet"
        else:
            cost = f"save cost {ctx.save_cost:.3g} s"
        reason = f"Young/Daly interval {interval:.0f} s ({cost}, MTBF {num(self._mtbf_hours)} h)"
        return SaveDecision(kind=self._what, reason=reason)

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        self._timer.rearm(ctx.now)

    def __repr__(self) -> str:
        parts = [num(self._mtbf_hours)]
        if self._min_seconds != 60:
            parts.append(f"min_seconds={num(self._min_seconds)}")
        if self._max_seconds is not None:
            parts.append(f"max_seconds={num(self._max_seconds)}")
        if self._what != "full":
            parts.append(f"what={self._what!r}")
        return f"YoungDaly({', '.join(parts)})"
