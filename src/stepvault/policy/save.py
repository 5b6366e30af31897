"""Save policies: when to write a checkpoint.

Each rule is a small object that prints as the expression that built it, composes with
``|`` and is driven by synthetic :class:`SaveContext` values in tests, so a schedule can be
read, tested and dry-run without a training loop::

    policy = Every(steps=1000) | Every(minutes=30) | OnSignal()
    print(policy)   # Every(steps=1000) | Every(minutes=30) | OnSignal(SIGTERM, SIGUSR1)

The manager calls :meth:`SavePolicy.decide` at every step boundary, starts a save when it
gets a :class:`SaveDecision`, and then calls :meth:`SavePolicy.saved` so stateful rules
re-arm. Configuration is read-only after construction (properties without setters); the
only mutable parts are the timers and flags a rule needs to remember what it has seen.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
from types import FrameType
from typing import Literal

from .base import AnyOf, SaveContext, SaveDecision, SavePolicy, merge_decisions
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

SaveKind = Literal["full", "weights"]
_KINDS: tuple[str, ...] = ("full", "weights")


# --------------------------------------------------------------------------- helpers


def _check_kind(what: str) -> str:
    if what not in _KINDS:
        raise ValueError(f"what= must be 'full' or 'weights', got {what!r}")
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

    ``what`` is the kind of checkpoint: ``"full"`` (whole training state) or
    ``"weights"`` (modules only).
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
        checked = []
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


# --------------------------------------------------------------------------- preemption


def _default_signals() -> tuple[signal.Signals, ...]:
    # SIGUSR1 does not exist on Windows.
    names = ("SIGTERM", "SIGUSR1")
    return tuple(getattr(signal.Signals, n) for n in names if hasattr(signal.Signals, n))


def _to_signal(value: int | str | signal.Signals) -> signal.Signals:
    if isinstance(value, signal.Signals):
        sig = value
    elif isinstance(value, str):
        name = value.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {value!r}") from None
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            sig = signal.Signals(int(value))
        except ValueError:
            raise ValueError(f"unknown signal number {value!r}") from None
    else:
        raise ValueError(f"a signal is a signal.Signals, a number or a name, got {value!r}")
    uncatchable = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
    if sig in uncatchable:
        raise ValueError(f"{sig.name} cannot be caught, so it cannot trigger a save")
    return sig


class OnSignal(SavePolicy):
    """Save urgently when the process receives a signal (preemption), then exit or go on.

    Schedulers warn before they kill: SLURM sends the signal asked for with
    ``sbatch --signal=USR1@120`` (SIGUSR1 120 s before the time limit; use
    ``--signal=B:USR1@120`` to signal the batch shell only) and SIGTERM on
    ``scancel``/preemption; Kubernetes and spot/preemptible VMs (AWS spot two-minute
    notice, GCP preemptible, Azure spot) end in SIGTERM after a grace period. With the
    default ``OnSignal()`` (SIGTERM and SIGUSR1) the next step boundary after the signal
    writes a synchronous full checkpoint, and with ``action="exit"`` the manager then
    exits with ``exit_code`` (default ``128 + signum``, the shell convention, e.g. 143 for
    SIGTERM, so the scheduler sees "killed by signal" and may requeue).
    ``action="continue"`` saves and keeps training (e.g. a "checkpoint now" USR1 from an
    operator).

    :meth:`install` (main thread only: Python runs signal handlers there) replaces the
    handlers with ones that only record the signal; nothing is written inside a signal
    handler, since it could interrupt the training step at any bytecode. Previous
    handlers are not chained (the default SIGTERM action would kill the process before
    the save) and are restored by :meth:`uninstall`.

    A received signal stays pending (:attr:`triggered`) until a save that this rule
    reported is acknowledged through :meth:`saved`; a signal that arrives between
    ``decide`` and ``saved`` is not lost. :meth:`trigger` simulates a signal (tests,
    programmatic preemption).
    """

    def __init__(
        self,
        *signals: int | str | signal.Signals,
        action: Literal["exit", "continue"] = "exit",
        exit_code: int | None = None,
    ) -> None:
        chosen = tuple(_to_signal(s) for s in signals) if signals else _default_signals()
        self._signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(chosen))
        if action not in ("exit", "continue"):
            raise ValueError(f"action= must be 'exit' or 'continue', got {action!r}")
        if exit_code is not None:
            if action != "exit":
                raise ValueError("exit_code= only makes sense with action='exit'")
            if isinstance(exit_code, bool) or not isinstance(exit_code, numbers.Integral):
                raise ValueError(f"exit_code= must be an integer, got {exit_code!r}")
            if not 0 <= exit_code <= 255:
                raise ValueError(f"exit_code= must be in 0..255, got {exit_code!r}")
        self._action = action
        self._exit_code = None if exit_code is None else int(exit_code)
        # Counters rather than a flag: the handler can run between any two bytecodes,
        # including between decide() and saved(); comparing counts tells a signal that
        # was reported (and saved for) from one that arrived afterwards.
        self._received = 0
        self._handled = 0
        self._reported: int | None = None
        self._signum: int | None = None
        self._previous: dict[signal.Signals, object] | None = None

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        return self._signals

    @property
    def action(self) -> str:
        return self._action

    @property
    def exit_code(self) -> int | None:
        """The configured exit code (None: ``128 + signum`` for action="exit")."""
        return self._exit_code

    @property
    def triggered(self) -> bool:
        """True while a received signal has not been saved for."""
        return self._received > self._handled

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def trigger(self, signum: int | str | signal.Signals = signal.SIGTERM) -> None:
        """Act as if ``signum`` had been received (tests, programmatic preemption)."""
        self._record(int(_to_signal(signum)))

    def _record(self, signum: int) -> None:
        self._signum = signum
        self._received += 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._record(signum)

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        received = self._received
        if received <= self._handled or self._signum is None:
            return None
        self._reported = received
        signum = self._signum
        if self._action == "exit":
            code: int | None = self._exit_code if self._exit_code is not None else 128 + signum
        else:
            code = None
        return SaveDecision(
            kind="full", reason=f"signal {_signal_name(signum)}", urgent=True, exit_code=code
        )

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        # Only an urgent save after this rule reported a signal answers that signal; an
        # ordinary background save in between does not.
        if decision.urgent and self._reported is not None:
            self._handled = max(self._handled, self._reported)
            self._reported = None

    def install(self) -> None:
        _require_main_thread("OnSignal.install()")
        if self._previous is not None:
            return  # already installed: keep the handlers we saved the first time
        previous: dict[signal.Signals, object] = {}
        try:
            for sig in self._signals:
                previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        except BaseException:
            for sig, handler in previous.items():
                signal.signal(sig, _restorable(handler))
            raise
        self._previous = previous

    def uninstall(self) -> None:
        if self._previous is None:
            return
        _require_main_thread("OnSignal.uninstall()")
        for sig, handler in self._previous.items():
            # If someone replaced our handler since, theirs is the one in charge now;
            # putting the old one back would silently disable it.
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, _restorable(handler))
        self._previous = None

    def __repr__(self) -> str:
        parts = [s.name for s in self._signals]
        if self._action != "exit":
            parts.append(f"action={self._action!r}")
        if self._exit_code is not None:
            parts.append(f"exit_code={self._exit_code}")
        return f"OnSignal({', '.join(parts)})"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _restorable(handler: object) -> object:
    # getsignal() returns None for handlers not installed from Python; signal() refuses
    # None, and the default action is the closest thing we can put back.
    return signal.SIG_DFL if handler is None else handler


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what} must be called from the main thread: Python only runs signal "
            "handlers there (create the CheckpointManager in the training script's main "
            "thread, before starting worker threads)"
        )


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
