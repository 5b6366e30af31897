"""Save policies: every rule on synthetic step boundaries (no sleeping), composition,
reprs, real signals, and the Young/Daly interval."""

from __future__ import annotations

import math
import os
import signal
import threading

import pytest

from stepvault.policy import (
    AnyOf,
    AtSteps,
    Every,
    FirstStep,
    LastStep,
    OnSignal,
    SaveContext,
    SaveDecision,
    SavePolicy,
    YoungDaly,
    merge_decisions,
)


def ctx(
    step: int,
    now: float = 0.0,
    *,
    epoch: int | None = None,
    save_cost: float | None = None,
    total_steps: int | None = None,
) -> SaveContext:
    return SaveContext(
        step=step, epoch=epoch, now=now, save_cost=save_cost, total_steps=total_steps
    )


def drive(policy: SavePolicy, contexts: list[SaveContext]) -> list[int]:
    """Run a policy like the manager does; return the steps at which it saved."""
    fired = []
    for c in contexts:
        decision = policy.decide(c)
        if decision is not None:
            fired.append(c.step)
            policy.saved(c, decision)
    return fired


# --------------------------------------------------------------------------- Every


def test_every_steps_fires_on_multiples_but_not_step_zero():
    policy = Every(steps=3)
    assert drive(policy, [ctx(s) for s in range(11)]) == [3, 6, 9]
    decision = policy.decide(ctx(3000))
    assert decision == SaveDecision(kind="full", reason="every 3 steps")


def test_every_steps_is_stateless_across_resume():
    # A resumed run starting at step 2500 still saves at multiples of 1000.
    policy = Every(steps=1000)
    assert drive(policy, [ctx(s) for s in range(2500, 5001, 100)]) == [3000, 4000, 5000]


def test_every_weights_kind_and_repr():
    policy = Every(steps=500, what="weights")
    assert policy.decide(ctx(500)) == SaveDecision(kind="weights", reason="every 500 steps")
    assert repr(policy) == "Every(steps=500, what='weights')"


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"steps": 1000}, "Every(steps=1000)"),
        ({"epochs": 2}, "Every(epochs=2)"),
        ({"seconds": 90}, "Every(seconds=90)"),
        ({"minutes": 30}, "Every(minutes=30)"),
        ({"minutes": 0.5}, "Every(minutes=0.5)"),
        ({"hours": 1}, "Every(hours=1)"),
    ],
)
def test_every_repr(kwargs, text):
    assert repr(Every(**kwargs)) == text


def test_every_epochs_fires_on_entering_a_new_multiple():
    policy = Every(epochs=2)
    # 5 steps per epoch; the first call (epoch 0) is the baseline.
    contexts = [ctx(s, epoch=s // 5) for s in range(0, 31)]
    assert drive(policy, contexts) == [10, 20, 30]
    assert Every(epochs=1).decide(ctx(5, epoch=1)) is None  # first call: baseline only


def test_every_epochs_after_resume_and_without_epochs():
    policy = Every(epochs=2)
    # Resumed in epoch 5: the next multiple of 2 is epoch 6.
    contexts = [ctx(s, epoch=e) for s, e in [(50, 5), (55, 5), (60, 6), (65, 6), (70, 7)]]
    assert drive(policy, contexts) == [60]
    assert drive(Every(epochs=1), [ctx(s, epoch=None) for s in range(10)]) == []
    reason = Every(epochs=1)
    reason.decide(ctx(0, epoch=0))
    assert reason.decide(ctx(1, epoch=1)) == SaveDecision(reason="every 1 epoch")


def test_every_epochs_is_not_reset_by_other_saves():
    policy = Every(epochs=1)
    policy.decide(ctx(0, epoch=0))
    policy.saved(ctx(3, epoch=0), SaveDecision())  # e.g. a step-triggered save
    assert policy.decide(ctx(5, epoch=1)) is not None


def test_every_time_first_call_anchors_then_fires_after_interval():
    policy = Every(seconds=100)
    assert policy.decide(ctx(1, now=5000.0)) is None  # anchor, even at a large now
    assert policy.decide(ctx(2, now=5099.9)) is None
    assert policy.decide(ctx(3, now=5100.0)) == SaveDecision(reason="every 100 seconds")
    # It re-armed at its own firing even though saved() was not called.
    assert policy.decide(ctx(4, now=5150.0)) is None
    assert policy.decide(ctx(5, now=5200.0)) is not None


def test_every_minutes_and_hours_units():
    minutes, hours = Every(minutes=2), Every(hours=1)
    assert minutes.interval_seconds == 120 and hours.interval_seconds == 3600
    assert Every(steps=5).interval_seconds is None
    contexts = [ctx(i, now=60.0 * i) for i in range(0, 130)]
    assert drive(minutes, contexts) == list(range(2, 130, 2))
    assert drive(hours, contexts) == [60, 120]
    assert Every(hours=1).decide(ctx(0, now=0)) is None
    one_hour = Every(hours=1)
    one_hour.decide(ctx(0, now=0))
    assert one_hour.decide(ctx(1, now=3600)).reason == "every 1 hour"


def test_step_triggered_save_rearms_the_wall_clock_timer():
    policy = Every(steps=10) | Every(seconds=100)
    contexts = [ctx(s, now=9.0 * s) for s in range(0, 40)]
    # Step saves at 10 (t=90), 20 (t=180), 30 (t=270) each reset the 100 s timer, so
    # the timer itself never fires.
    assert drive(policy, contexts) == [10, 20, 30]
    # Without the step rule the timer fires at t >= 100 after the last firing.
    timer_only = Every(seconds=100)
    assert drive(timer_only, contexts) == [12, 24, 36]


def test_saved_rearms_the_timer_with_the_save_time():
    policy = Every(seconds=100)
    policy.decide(ctx(0, now=0))
    policy.saved(ctx(5, now=80), SaveDecision(reason="manual"))
    assert policy.decide(ctx(6, now=150)) is None
    assert policy.decide(ctx(7, now=180)) is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"steps": 10, "minutes": 5},
        {"seconds": 1, "hours": 1},
    ],
)
def test_every_needs_exactly_one_interval(kwargs):
    with pytest.raises(ValueError, match="exactly one interval"):
        Every(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"steps": 0},
        {"steps": -5},
        {"steps": 2.5},
        {"steps": True},
        {"epochs": 0},
        {"seconds": 0},
        {"minutes": -1},
        {"hours": math.inf},
        {"seconds": math.nan},
        {"steps": 10, "what": "partial"},
    ],
)
def test_every_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        Every(**kwargs)


def test_every_config_is_read_only():
    policy = Every(steps=10)
    assert (policy.unit, policy.value, policy.what) == ("steps", 10, "full")
    with pytest.raises(AttributeError):
        policy.value = 5  # type: ignore[misc]


# --------------------------------------------------------------------------- AtSteps, First, Last


def test_at_steps():
    policy = AtSteps(300, 100, 100, what="weights")
    assert policy.steps == (100, 300)
    assert repr(policy) == "AtSteps(100, 300, what='weights')"
    assert drive(policy, [ctx(s) for s in range(0, 400, 50)]) == [100, 300]
    assert policy.decide(ctx(100)) == SaveDecision(kind="weights", reason="at step 100")
    assert repr(AtSteps(0)) == "AtSteps(0)"
    assert AtSteps(0).decide(ctx(0)) is not None
    with pytest.raises(ValueError):
        AtSteps()
    with pytest.raises(ValueError):
        AtSteps(-1)
    with pytest.raises(ValueError):
        AtSteps(1.5)  # type: ignore[arg-type]


def test_first_step_fires_once_on_the_first_call_whatever_the_step():
    policy = FirstStep()
    assert drive(policy, [ctx(s) for s in range(7000, 7010)]) == [7000]
    assert FirstStep().decide(ctx(0)) == SaveDecision(reason="first step of this process")
    assert repr(FirstStep()) == "FirstStep()"
    assert repr(FirstStep(what="weights")) == "FirstStep(what='weights')"


def test_last_step():
    policy = LastStep()
    assert policy.decide(ctx(99, total_steps=100)) is None
    assert policy.decide(ctx(100, total_steps=100)) == SaveDecision(reason="last step (100)")
    assert policy.decide(ctx(101, total_steps=100)) is not None
    assert policy.decide(ctx(10**9, total_steps=None)) is None
    assert repr(policy) == "LastStep()"


# --------------------------------------------------------------------------- composition


def test_or_flattens_into_one_anyof_with_readable_repr():
    a, b, c = Every(steps=1000), Every(minutes=30), OnSignal(signal.SIGTERM)
    policy = a | b | c
    assert isinstance(policy, AnyOf)
    assert policy.policies == (a, b, c)
    assert repr(policy) == "Every(steps=1000) | Every(minutes=30) | OnSignal(SIGTERM)"
    nested = AnyOf(a, AnyOf(b, c)) | (FirstStep() | LastStep())
    assert [type(p).__name__ for p in nested.policies] == [
        "Every",
        "Every",
        "OnSignal",
        "FirstStep",
        "LastStep",
    ]
    assert repr(AnyOf(a)) == "AnyOf(Every(steps=1000))"
    # The same object twice is asked once.
    assert AnyOf(a, a).policies == (a,)


def test_anyof_rejects_non_policies_and_empty():
    with pytest.raises(TypeError):
        Every(steps=1) | 5  # type: ignore[operator]
    with pytest.raises(ValueError):
        AnyOf()


def test_anyof_asks_every_member_even_after_one_fired():
    first = FirstStep()
    policy = Every(steps=1) | first
    d = policy.decide(ctx(1))
    assert d is not None and d.reason == "every 1 step; first step of this process"
    # FirstStep saw step 1 although the earlier member had already fired.
    assert first.decide(ctx(2)) is None


def test_anyof_merges_to_the_strongest_decision():
    weights = Every(steps=10, what="weights")
    sig = OnSignal(signal.SIGTERM)
    sig.trigger()
    policy = weights | sig
    d = policy.decide(ctx(10))
    assert d == SaveDecision(
        kind="full", reason="every 10 steps; signal SIGTERM", urgent=True, exit_code=143
    )
    # Only weights rules firing -> weights.
    only_weights = Every(steps=10, what="weights") | AtSteps(10, what="weights")
    assert only_weights.decide(ctx(10)) == SaveDecision(
        kind="weights", reason="every 10 steps; at step 10"
    )
    mixed = Every(steps=10, what="weights") | AtSteps(10)
    assert mixed.decide(ctx(10)).kind == "full"
    assert policy.decide(ctx(11)) is not None  # signal still pending: not saved yet
    assert (Every(steps=10) | LastStep()).decide(ctx(11)) is None


def test_merge_decisions_exit_code_from_urgent_and_dedup_reasons():
    calm = SaveDecision(reason="a")
    keep_going = SaveDecision(reason="b", urgent=True)
    leave = SaveDecision(reason="c", urgent=True, exit_code=7)
    merged = merge_decisions([calm, keep_going, leave, SaveDecision(reason="a")])
    assert merged == SaveDecision(kind="full", reason="a; b; c", urgent=True, exit_code=7)
    assert merge_decisions([]) is None
    assert merge_decisions([calm]) is calm


def test_anyof_saved_fans_out_to_every_member():
    sig = OnSignal(signal.SIGUSR1, action="continue")
    timer = Every(seconds=50)
    policy = sig | timer
    policy.decide(ctx(0, now=0))
    sig.trigger(signal.SIGUSR1)
    d = policy.decide(ctx(1, now=10))
    assert d == SaveDecision(reason="signal SIGUSR1", urgent=True, exit_code=None)
    policy.saved(ctx(1, now=10), d)
    assert not sig.triggered
    # The timer was re-armed at t=10 by the signal save.
    assert policy.decide(ctx(2, now=55)) is None
    assert policy.decide(ctx(3, now=60)) is not None


def test_anyof_install_rolls_back_when_a_member_fails():
    class Broken(SavePolicy):
        def decide(self, ctx):
            return None

        def install(self):
            raise RuntimeError("nope")

    previous = signal.getsignal(signal.SIGUSR1)
    sig = OnSignal(signal.SIGUSR1)
    with pytest.raises(RuntimeError, match="nope"):
        (sig | Broken()).install()
    assert not sig.installed
    assert signal.getsignal(signal.SIGUSR1) == previous


# --------------------------------------------------------------------------- OnSignal


@pytest.fixture
def sentinel_usr1():
    """A known previous SIGUSR1 handler, restored after the test."""
    calls = []

    def sentinel(signum, frame):
        calls.append(signum)

    original = signal.signal(signal.SIGUSR1, sentinel)
    try:
        yield sentinel
    finally:
        signal.signal(signal.SIGUSR1, original)


def _wait_for(policy: OnSignal) -> None:
    # Python runs the handler at the next bytecode boundary after the C-level signal;
    # for a signal sent to ourselves that is immediate, but don't rely on exact timing.
    for _ in range(10_000):
        if policy.triggered:
            return
    raise AssertionError("signal handler did not run")


@pytest.mark.parametrize(
    ("action", "expected_code"),
    [("exit", 128 + signal.SIGUSR1), ("continue", None)],
)
def test_on_signal_real_signal(sentinel_usr1, action, expected_code):
    policy = OnSignal(signal.SIGTERM, signal.SIGUSR1, action=action)
    assert policy.decide(ctx(1)) is None
    policy.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) != sentinel_usr1
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(policy)
        decision = policy.decide(ctx(2))
        assert decision == SaveDecision(
            kind="full", reason="signal SIGUSR1", urgent=True, exit_code=expected_code
        )
        # Pending until a save is acknowledged.
        assert policy.decide(ctx(3)) == decision
        policy.saved(ctx(3), decision)
        assert not policy.triggered
        assert policy.decide(ctx(4)) is None
    finally:
        policy.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is sentinel_usr1
    assert not policy.installed


def test_on_signal_uninstall_restores_default_handlers():
    before = signal.getsignal(signal.SIGTERM)
    policy = OnSignal()
    policy.install()
    policy.install()  # idempotent: must not record our own handler as "previous"
    try:
        assert signal.getsignal(signal.SIGTERM) != before
    finally:
        policy.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
    policy.uninstall()  # no-op


def test_on_signal_uninstall_leaves_a_newer_handler_alone(sentinel_usr1):
    policy = OnSignal(signal.SIGUSR1)
    policy.install()

    def newer(signum, frame):
        pass

    signal.signal(signal.SIGUSR1, newer)
    policy.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is newer


def test_on_signal_install_outside_main_thread_is_refused():
    policy = OnSignal()
    errors: list[BaseException] = []

    def run():
        try:
            policy.install()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0])
    assert not policy.installed


def test_on_signal_trigger_exit_codes():
    policy = OnSignal()
    assert not policy.triggered
    policy.trigger()
    assert policy.triggered
    assert policy.decide(ctx(1)).exit_code == 143
    fixed = OnSignal(exit_code=0)
    fixed.trigger("USR1")
    assert fixed.decide(ctx(1)) == SaveDecision(reason="signal SIGUSR1", urgent=True, exit_code=0)


def test_on_signal_arriving_between_decide_and_saved_is_not_lost():
    policy = OnSignal()
    policy.trigger(signal.SIGUSR1)
    decision = policy.decide(ctx(1))
    policy.trigger(signal.SIGTERM)  # arrives while the save runs
    policy.saved(ctx(1), decision)
    assert policy.triggered
    assert policy.decide(ctx(2)).reason == "signal SIGTERM"


def test_on_signal_non_urgent_save_does_not_clear_the_signal():
    policy = OnSignal()
    policy.trigger()
    policy.decide(ctx(1))
    policy.saved(ctx(1), SaveDecision(reason="every 10 steps"))
    assert policy.triggered
    # A saved() without a decide() having reported it clears nothing either.
    fresh = OnSignal()
    fresh.trigger()
    fresh.saved(ctx(1), SaveDecision(urgent=True))
    assert fresh.triggered


def test_on_signal_repr_and_validation():
    assert repr(OnSignal()) == "OnSignal(SIGTERM, SIGUSR1)"
    assert repr(OnSignal("term")) == "OnSignal(SIGTERM)"
    assert repr(OnSignal(signal.SIGUSR1, action="continue")) == (
        "OnSignal(SIGUSR1, action='continue')"
    )
    assert repr(OnSignal(15, exit_code=0)) == "OnSignal(SIGTERM, exit_code=0)"
    assert OnSignal(signal.SIGTERM, "SIGTERM").signals == (signal.SIGTERM,)
    for bad in [
        {"action": "stop"},
        {"action": "continue", "exit_code": 1},
        {"exit_code": 256},
        {"exit_code": -1},
    ]:
        with pytest.raises(ValueError):
            OnSignal(**bad)
    with pytest.raises(ValueError, match="cannot be caught"):
        OnSignal(signal.SIGKILL)
    with pytest.raises(ValueError, match="unknown signal"):
        OnSignal("SIGNOPE")


# --------------------------------------------------------------------------- Young/Daly


def test_young_daly_interval_math():
    policy = YoungDaly(24)
    assert policy.interval(60) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert policy.interval(60) == pytest.approx(3220, abs=1)
    # Quadrupling the cost doubles the interval.
    assert policy.interval(240) == pytest.approx(2 * policy.interval(60))
    # Unknown or degenerate cost: the minimum.
    assert policy.interval(None) == 60
    assert policy.interval(0) == 60
    assert policy.interval(-3) == 60
    assert policy.interval(math.nan) == 60


def test_young_daly_clamps():
    policy = YoungDaly(1000, min_seconds=600, max_seconds=3600)
    assert policy.interval(0.01) == 600  # sqrt(2*0.01*3.6e6) ≈ 268 -> 600
    assert policy.interval(60) == 3600  # ≈ 20785 -> 3600
    assert policy.interval(1) == pytest.approx(math.sqrt(2 * 3.6e6))  # ≈ 2683, inside
    with pytest.raises(ValueError):
        YoungDaly(0)
    with pytest.raises(ValueError):
        YoungDaly(24, min_seconds=100, max_seconds=50)
    with pytest.raises(ValueError):
        YoungDaly(24, min_seconds=-1)


def test_young_daly_fires_like_a_timer_and_adapts_to_cost():
    policy = YoungDaly(24, min_seconds=60)
    assert policy.decide(ctx(0, now=1000)) is None  # anchor
    assert policy.decide(ctx(1, now=1059)) is None
    first = policy.decide(ctx(2, now=1060))  # no cost measured yet: min_seconds
    assert first is not None and "not measured" in first.reason
    policy.saved(ctx(2, now=1060), first)
    # Cost now known (60 s): next save ≈ 3220 s later.
    assert policy.decide(ctx(3, now=1060 + 3219, save_cost=60)) is None
    second = policy.decide(ctx(4, now=1060 + 3220, save_cost=60))
    assert second == SaveDecision(reason="Young/Daly interval 3220 s (save cost 60 s, MTBF 24 h)")


def test_young_daly_repr():
    assert repr(YoungDaly(24)) == "YoungDaly(24)"
    assert repr(YoungDaly(2.5, min_seconds=30, max_seconds=7200, what="weights")) == (
        "YoungDaly(2.5, min_seconds=30, max_seconds=7200, what='weights')"
    )
