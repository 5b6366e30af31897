"""Preemption: save urgently when the process receives a signal (:class:`OnSignal`).

Kept apart from the interval rules of :mod:`.save` (which re-exports it) because it is the
one rule that touches process state: signal handlers, installed on the main thread.
"""

from __future__ import annotations

import numbers
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Literal, TypeAlias

from .base import SaveContext, SaveDecision, SavePolicy

__all__ = ["OnSignal"]

# What signal.getsignal() returns and signal.signal() accepts (typeshed's private _HANDLER).
_Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


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
        self._previous: dict[signal.Signals, _Handler] | None = None

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
        previous: dict[signal.Signals, _Handler] = {}
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


def _restorable(handler: _Handler) -> _Handler:
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
