"""Keep policies and retention plans: each rule, composition, reprs, and properties that
no composition of rules can delete the checkpoints a run cannot afford to lose."""

from __future__ import annotations

import math
import random
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepvault.policy import (
    CheckpointRecord,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPeriodic,
    KeepPinned,
    KeepPolicy,
    KeepWithin,
    RetentionPlan,
    plan_retention,
    tracked_metrics,
)

DAY = 86400.0
NOW = 1_700_000_000.0  # fixed Unix time: plans must not depend on the real clock


def rec(
    step: int,
    created: float | None = None,
    *,
    kind: str = "full",
    pinned: bool = False,
    valid: bool = True,
    **metrics: float,
) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        created=NOW - DAY + step if created is None else created,
        metrics=dict(metrics),
        kind=kind,
        pinned=pinned,
        valid=valid,
    )


def reasons_by_step(plan: RetentionPlan) -> dict[int, list[str]]:
    return {e.step: e.reasons for e in plan.entries}


# --------------------------------------------------------------------------- single rules


def test_keep_last_counts_only_valid_records():
    records = [rec(s) for s in range(0, 60, 10)] + [rec(60, valid=False)]
    assert KeepLast(2).select(records, NOW) == {40: "last 2", 50: "last 2"}
    assert KeepLast(100).select(records, NOW).keys() == {0, 10, 20, 30, 40, 50}


def test_keep_last_with_kind():
    records = [rec(1), rec(2, kind="weights"), rec(3), rec(4, kind="weights")]
    assert KeepLast(1, kind="weights").select(records, NOW) == {4: "last 1 weights"}
    assert KeepLast(1, kind="full").select(records, NOW) == {3: "last 1 full"}
    assert KeepLast(1).select(records, NOW) == {4: "last 1"}


def test_keep_best_min_max_ties_and_missing_metrics():
    records = [
        rec(1, val_loss=3.0, acc=0.5),
        rec(2, val_loss=1.0),
        rec(3),  # not evaluated
        rec(4, val_loss=math.nan),
        rec(5, val_loss=1.0, acc=0.9),  # ties with step 2: newer wins
        rec(6, val_loss=0.1, valid=False),  # damaged: never best
        rec(7, val_loss=math.inf),
        rec(8, val_loss=2.0, acc=0.7),
    ]
    reason = "best 2 by val_loss (min)"
    assert KeepBest(2, "val_loss").select(records, NOW) == {5: reason, 2: reason}
    assert KeepBest(1, "val_loss").select(records, NOW) == {5: "best 1 by val_loss (min)"}
    assert KeepBest(2, "acc", mode="max").select(records, NOW) == {
        5: "best 2 by acc (max)",
        8: "best 2 by acc (max)",
    }
    # Fewer evaluated checkpoints than n: keeps those, never the unevaluated ones.
    assert KeepBest(10, "acc", mode="max").select(records, NOW).keys() == {1, 5, 8}
    assert KeepBest(3, "bleu").select(records, NOW) == {}


def test_keep_every():
    records = [rec(s) for s in (0, 5000, 10000, 15000, 20000)] + [rec(30000, valid=False)]
    assert KeepEvery(steps=10000).select(records, NOW) == {
        0: "every 10000 steps",
        10000: "every 10000 steps",
        20000: "every 10000 steps",
    }


def test_keep_within():
    records = [
        rec(1, NOW - 8 * DAY),
        rec(2, NOW - 7 * DAY),  # exactly on the edge: kept
        rec(3, NOW - 1),
        rec(4, NOW - 1, valid=False),
    ]
    assert KeepWithin(days=7).select(records, NOW) == {2: "within 7 days", 3: "within 7 days"}
    assert KeepWithin(hours=1).select(records, NOW) == {3: "within 1 hour"}
    assert KeepWithin(minutes=90).window_seconds == 5400
    assert KeepWithin(seconds=30).select(records, NOW) == {3: "within 30 seconds"}


def test_keep_within_needs_exactly_one_unit():
    with pytest.raises(ValueError, match="exactly one"):
        KeepWithin()
    with pytest.raises(ValueError, match="exactly one"):
        KeepWithin(days=1, hours=2)
    with pytest.raises(ValueError):
        KeepWithin(days=0)


def test_keep_periodic_newest_per_bucket_within_window():
    day0 = math.floor(NOW / DAY) * DAY  # start of today's UTC day
    records = [
        rec(1, day0 - 40 * DAY + 10),  # outside the 30-day window
        rec(2, day0 - 2 * DAY + 100),
        rec(3, day0 - 2 * DAY + 200),  # newest of that day
        rec(4, day0 - DAY + 5),
        rec(5, day0 - DAY + 50, valid=False),  # damaged: does not represent its day
        rec(6, day0 + 1),
        rec(7, day0 + 2),
    ]
    policy = KeepPeriodic(timedelta(days=1), within=timedelta(days=30))
    reason = "one per 1 day for 30 days"
    assert policy.select(records, NOW) == {3: reason, 4: reason, 7: reason}
    forever = KeepPeriodic(timedelta(days=1))
    assert forever.select(records, NOW) == {
        1: "one per 1 day",
        3: "one per 1 day",
        4: "one per 1 day",
        7: "one per 1 day",
    }
    # Seconds work too; a bucket's pick does not move as time passes.
    hourly = KeepPeriodic(3600)
    assert hourly.select(records, NOW) == hourly.select(records, NOW + 50 * DAY)
    assert hourly.select(records, NOW)[1] == "one per 1 hour"
    assert KeepPeriodic(timedelta(minutes=90)).select(records, NOW)[7] == "one per 90 minutes"


def test_keep_pinned_keeps_damaged_pins():
    records = [rec(1, pinned=True), rec(2), rec(3, pinned=True, valid=False)]
    assert KeepPinned().select(records, NOW) == {1: "pinned", 3: "pinned"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLast(0),
        lambda: KeepLast(2.5),
        lambda: KeepLast(True),
        lambda: KeepBest(0, "loss"),
        lambda: KeepBest(1, ""),
        lambda: KeepBest(1, "loss", mode="lowest"),
        lambda: KeepEvery(steps=0),
        lambda: KeepPeriodic(timedelta(0)),
        lambda: KeepPeriodic(timedelta(days=1), within=-5),
        lambda: KeepPeriodic("daily"),
    ],
)
def test_rules_reject_bad_configuration(make):
    with pytest.raises(ValueError):
        make()


# --------------------------------------------------------------------------- composition


def test_or_flattens_and_prints():
    policy = KeepLast(3) | KeepBest(2, "val_loss") | KeepEvery(steps=10000)
    assert isinstance(policy, KeepAny)
    assert len(policy.policies) == 3
    assert repr(policy) == (
        "KeepLast(3) | KeepBest(2, 'val_loss', mode='min') | KeepEvery(steps=10000)"
    )
    bigger = (KeepWithin(days=7) | KeepPinned()) | policy
    assert repr(bigger) == (
        "KeepWithin(days=7) | KeepPinned() | KeepLast(3) | "
        "KeepBest(2, 'val_loss', mode='min') | KeepEvery(steps=10000)"
    )
    assert repr(KeepAny(KeepLast(1))) == "KeepAny(KeepLast(1))"
    assert repr(KeepPeriodic(timedelta(days=1), within=timedelta(days=30))) == (
        "KeepPeriodic(timedelta(days=1), within=timedelta(days=30))"
    )
    assert repr(KeepLast(2, kind="weights")) == "KeepLast(2, kind='weights')"
    with pytest.raises(TypeError):
        KeepLast(1) | "everything"  # type: ignore[operator]
    with pytest.raises(ValueError):
        KeepAny()


def test_rules_are_values():
    assert KeepLast(3) == KeepLast(3)
    assert KeepLast(3) != KeepLast(4)
    assert KeepBest(1, "a") != KeepBest(1, "a", mode="max")
    assert len({KeepLast(3), KeepLast(3), KeepEvery(steps=3)}) == 2
    # Equal rules are merged, so a reason is not listed twice.
    assert (KeepLast(3) | KeepLast(3)).policies == (KeepLast(3),)


def test_keep_any_joins_reasons_in_member_order():
    records = [rec(s, val_loss=float(10 - s)) for s in range(1, 11)]
    policy = KeepLast(2) | KeepBest(1, "val_loss") | KeepEvery(steps=5)
    assert policy.select(records, NOW) == {
        5: "every 5 steps",
        9: "last 2",
        10: "last 2; best 1 by val_loss (min); every 5 steps",
    }


def test_tracked_metrics_walks_compositions():
    policy = KeepLast(1) | KeepBest(1, "loss") | (KeepBest(2, "acc", "max") | KeepBest(3, "loss"))
    assert tracked_metrics(policy) == (("loss", "min"), ("acc", "max"))
    assert tracked_metrics(KeepLast(1)) == ()
    assert tracked_metrics(None) == ()


# --------------------------------------------------------------------------- plan_retention


def test_plan_keeps_newest_valid_full_even_if_no_rule_does():
    records = [
        rec(100),
        rec(200),
        rec(300, kind="weights"),
        rec(400, valid=False),
    ]
    plan = plan_retention(records, KeepEvery(steps=1000), now=NOW)
    assert plan.keep == [200]
    assert plan.delete == [100, 300, 400]
    reasons = reasons_by_step(plan)
    assert reasons[200] == ["newest valid checkpoint (needed to resume)"]
    assert reasons[100] == ["no rule keeps it"]
    assert reasons[400] == ["damaged (valid=False) and not pinned"]


def test_plan_keeps_pins_and_current_best_with_all_reasons():
    records = [
        rec(100, val_loss=0.5, pinned=True),
        rec(200, val_loss=0.2),
        rec(300, val_loss=0.9),
        rec(400, valid=False, pinned=True),
        rec(500, val_loss=0.7),
    ]
    plan = plan_retention(records, KeepLast(1) | KeepBest(1, "val_loss"), now=NOW)
    assert plan.keep == [100, 200, 400, 500]
    assert reasons_by_step(plan) == {
        100: ["pinned"],
        200: ["best 1 by val_loss (min)", "current best by val_loss"],
        300: ["no rule keeps it"],
        400: ["pinned"],
        500: ["last 1", "newest valid checkpoint (needed to resume)"],
    }
    assert [e["step"] for e in plan.to_json()] == [100, 200, 300, 400, 500]
    text = str(plan)
    assert "delete        300  no rule keeps it" in text


def test_plan_best_metrics_explicit_and_mode_labels():
    records = [rec(1, loss=1.0), rec(2, loss=3.0), rec(3, loss=2.0), rec(4)]
    plan = plan_retention(
        records, KeepLast(1), now=NOW, best_metrics=[("loss", "min"), ("loss", "max")]
    )
    assert reasons_by_step(plan) == {
        1: ["current best by loss (min)"],
        2: ["current best by loss (max)"],
        3: ["no rule keeps it"],
        4: ["last 1", "newest valid checkpoint (needed to resume)"],
    }
    # An explicit empty list turns the metric invariant off (the rule itself still runs).
    plan = plan_retention(records, KeepBest(1, "loss"), now=NOW, best_metrics=())
    assert reasons_by_step(plan)[1] == ["best 1 by loss (min)"]
    with pytest.raises(ValueError):
        plan_retention(records, None, now=NOW, best_metrics=[("loss", "lowest")])


def test_plan_without_policy_keeps_everything():
    records = [rec(2, valid=False), rec(1, pinned=True)]
    plan = plan_retention(records, None, now=NOW)
    assert plan.delete == []
    assert reasons_by_step(plan) == {
        1: ["no keep policy", "pinned", "newest valid checkpoint (needed to resume)"],
        2: ["no keep policy"],
    }


def test_plan_rejects_duplicate_steps_and_handles_empty():
    with pytest.raises(ValueError, match="duplicate"):
        plan_retention([rec(1), rec(1)], KeepLast(1), now=NOW)
    assert plan_retention([], KeepLast(1), now=NOW).entries == []


def test_plan_ignores_steps_a_custom_rule_invents():
    class Liar(KeepPolicy):
        def select(self, records, now):
            return {999: "imaginary", records[0].step: "first; and only"}

    plan = plan_retention([rec(1), rec(2)], Liar(), now=NOW)
    assert reasons_by_step(plan) == {
        1: ["first", "and only"],
        2: ["newest valid checkpoint (needed to resume)"],
    }


def test_plan_of_a_realistic_run():
    # 30 days of hourly checkpoints every 500 steps, evaluated every 4th save.
    records = []
    for i in range(30 * 24):
        metrics = {"val_loss": 2.0 / (1 + i) + (i % 7) * 0.001} if i % 4 == 0 else {}
        records.append(
            CheckpointRecord(step=500 * (i + 1), created=NOW - 3600 * (720 - i), metrics=metrics)
        )
    policy = (
        KeepLast(3)
        | KeepBest(2, "val_loss")
        | KeepWithin(hours=6)
        | KeepPeriodic(timedelta(days=1), within=timedelta(days=7))
        | KeepEvery(steps=100_000)
    )
    plan = plan_retention(records, policy, now=NOW)
    assert len(plan.entries) == 720
    assert records[-1].step in plan.keep
    # ~6 recent + 7 daily + best 2 + 3 trail points: a few dozen, not hundreds.
    assert 10 <= len(plan.keep) <= 25
    assert all(e.reasons for e in plan.entries)


# --------------------------------------------------------------------------- properties

METRICS = ("loss", "acc")


@st.composite
def record_lists(draw) -> list[CheckpointRecord]:
    steps = draw(st.lists(st.integers(0, 5000), unique=True, max_size=25))
    values = st.one_of(
        st.floats(-10, 10, allow_nan=False),
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.sampled_from([0.0, 1.0]),  # ties
    )
    records = []
    for step in steps:
        metrics = {m: draw(values) for m in METRICS if draw(st.booleans())}
        records.append(
            CheckpointRecord(
                step=step,
                created=NOW - draw(st.floats(0, 60 * DAY)),
                metrics=metrics,
                kind=draw(st.sampled_from(["full", "full", "weights"])),
                pinned=draw(st.integers(0, 5)) == 0,
                valid=draw(st.integers(0, 4)) != 0,
            )
        )
    return records


durations = st.sampled_from([60.0, 3600.0, DAY, 7 * DAY])

leaf_policies = st.one_of(
    st.builds(KeepLast, st.integers(1, 5), kind=st.sampled_from([None, "full", "weights"])),
    st.builds(
        KeepBest, st.integers(1, 4), st.sampled_from(METRICS), st.sampled_from(["min", "max"])
    ),
    st.builds(lambda n: KeepEvery(steps=n), st.integers(1, 1000)),
    st.builds(lambda h: KeepWithin(hours=h), st.integers(1, 24 * 30)),
    st.builds(KeepPeriodic, durations, st.one_of(st.none(), durations)),
    st.just(KeepPinned()),
)

keep_policies = st.one_of(
    leaf_policies,
    st.lists(leaf_policies, min_size=1, max_size=5).map(lambda ps: KeepAny(*ps)),
    # Nested unions, built with | as users would.
    st.lists(leaf_policies, min_size=2, max_size=4).map(
        lambda ps: (ps[0] | ps[1]) | KeepAny(*ps[2:], ps[0])
    ),
)


def _leaves(policy: KeepPolicy) -> list[KeepPolicy]:
    if isinstance(policy, KeepAny):
        return [leaf for p in policy.policies for leaf in _leaves(p)]
    return [policy]


def _finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


@settings(max_examples=200, deadline=None)
@given(records=record_lists(), policy=st.one_of(st.none(), keep_policies))
def test_no_policy_ever_deletes_what_must_survive(records, policy):
    plan = plan_retention(records, policy, now=NOW)
    kept = set(plan.keep)

    # Every record appears exactly once, in step order, and every entry says why.
    assert [e.step for e in plan.entries] == sorted(r.step for r in records)
    assert all(e.reasons for e in plan.entries)
    assert kept.isdisjoint(plan.delete)

    # (a) the newest valid full checkpoint (oracle written independently of keep.py)
    resumable = [r.step for r in records if r.valid and r.kind == "full"]
    if resumable:
        assert max(resumable) in kept

    # (b) the current best valid checkpoint for each KeepBest metric; ties -> newest
    for leaf in _leaves(policy) if policy is not None else []:
        if not isinstance(leaf, KeepBest):
            continue
        scored = [
            (r.metrics[leaf.metric], r.step)
            for r in records
            if r.valid and _finite(r.metrics.get(leaf.metric))
        ]
        if scored:
            best = min(v for v, _ in scored) if leaf.mode == "min" else max(v for v, _ in scored)
            assert max(s for v, s in scored if v == best) in kept

    # (c) every pinned checkpoint, damaged or not
    assert {r.step for r in records if r.pinned} <= kept

    # Whatever the rules select survives too, and damaged unpinned ones only via rules
    # (which never pick them) - i.e. never.
    if policy is not None:
        assert set(policy.select(sorted(records, key=lambda r: r.step), NOW)) <= kept
        assert not {r.step for r in records if not r.valid and not r.pinned} & kept


@settings(max_examples=200, deadline=None)
@given(records=record_lists(), policy=keep_policies, seed=st.integers(0, 2**32 - 1))
def test_plans_are_deterministic_and_ignore_input_order(records, policy, seed):
    first = plan_retention(records, policy, now=NOW).to_json()
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    assert plan_retention(shuffled, policy, now=NOW).to_json() == first
    assert plan_retention(records, policy, now=NOW).to_json() == first


@settings(max_examples=200, deadline=None)
@given(records=record_lists(), policy=keep_policies)
def test_kept_entries_are_exactly_rule_or_invariant(records, policy):
    """Nothing is kept without a reason and nothing with a reason is deleted: the set
    kept is the union of the rules' choices and the three invariants."""
    plan = plan_retention(records, policy, now=NOW)
    ordered = sorted(records, key=lambda r: r.step)
    expected = set(policy.select(ordered, NOW))
    expected |= {r.step for r in records if r.pinned}
    resumable = [r.step for r in records if r.valid and r.kind == "full"]
    if resumable:
        expected.add(max(resumable))
    for metric, mode in tracked_metrics(policy):
        scored = [
            (r.metrics[metric], r.step)
            for r in records
            if r.valid and _finite(r.metrics.get(metric))
        ]
        if scored:
            best = min(v for v, _ in scored) if mode == "min" else max(v for v, _ in scored)
            expected.add(max(s for v, s in scored if v == best))
    assert set(plan.keep) == expected
