"""Save, keep and tier rules check their numbers with one module (stepvault.policy.validate)
and refuse the same bad values with the messages they always gave."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from stepvault.policy import (
    Every,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPeriodic,
    KeepWithin,
    YoungDaly,
)
from stepvault.tiers import CopyEvery, HotLast, MoveAfter

REFUSED = [
    (lambda: Every(steps=True), "steps= must be a positive integer, got True"),
    (lambda: Every(epochs=0), "epochs= must be a positive integer, got 0"),
    (lambda: Every(minutes=math.nan), "minutes= must be a positive finite number, got nan"),
    (lambda: Every(seconds="5"), "seconds= must be a positive number, got '5'"),
    (lambda: YoungDaly(0), "mtbf_hours= must be a positive finite number, got 0"),
    (lambda: YoungDaly(1, min_seconds=-1), "min_seconds= must be a finite number >= 0, got -1"),
    (lambda: YoungDaly(1, min_seconds=None), "min_seconds= must be a number >= 0, got None"),
    (lambda: YoungDaly(1, max_seconds=math.inf), "max_seconds= must be a positive finite"),
    (lambda: KeepLast(0), "KeepLast(n) must be a positive integer, got 0"),
    (lambda: KeepBest(2.5, "loss"), "KeepBest(n) must be a positive integer, got 2.5"),
    (lambda: KeepEvery(steps=False), "KeepEvery(steps=) must be a positive integer, got False"),
    (lambda: KeepWithin(hours=-2), "KeepWithin(hours=) must be a positive duration, got -2"),
    (lambda: KeepWithin(days="1"), "KeepWithin(days=) must be a timedelta or seconds, got '1'"),
    (
        lambda: KeepPeriodic(timedelta(0)),
        "KeepPeriodic(every=) must be a positive duration, got datetime.timedelta(0)",
    ),
    (lambda: KeepPeriodic(60, within=True), "KeepPeriodic(within=) must be a timedelta or"),
    (lambda: HotLast(-1), "HotLast(k) must be a positive integer, got -1"),
    (lambda: CopyEvery("a", steps=1.0), "CopyEvery(steps=) must be a positive integer, got 1.0"),
    (lambda: CopyEvery("a"), "CopyEvery takes exactly one of minutes=, seconds=, hours="),
    (lambda: CopyEvery("a", minutes=0), "CopyEvery: the interval must be positive"),
    (lambda: MoveAfter("a", hours=-1), "MoveAfter: hours= must be a non-negative duration, got -1"),
    (lambda: MoveAfter("a", days="x"), "MoveAfter: days= must be a number or timedelta, got 'x'"),
    (lambda: MoveAfter("a", 5, hours=1), "MoveAfter takes exactly one of age=, minutes=, hours="),
]


@pytest.mark.parametrize(("build", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_numbers_are_refused_with_the_rules_message(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value).startswith(message)


def test_good_numbers_come_back_as_the_rules_read_them():
    assert Every(minutes=1.5).interval_seconds == 90.0
    assert YoungDaly(2, min_seconds=0).min_seconds == 0.0
    assert KeepWithin(minutes=90).window_seconds == 5400.0
    assert KeepPeriodic(timedelta(days=1), within=3600).within_seconds == 3600.0
    assert MoveAfter("a", timedelta(minutes=2)).age == 120.0  # a timedelta is not scaled
    assert MoveAfter("a", hours=0.5).age == 1800.0
    assert CopyEvery("a", hours=1).interval == 3600.0
    assert repr(MoveAfter("a", hours=0.5)) == "MoveAfter('a', minutes=30)"
    assert repr(Every(seconds=30.0)) == "Every(seconds=30)"
    assert repr(KeepWithin(minutes=0.5)) == "KeepWithin(minutes=0.5)"
