"""stepvault.planning.plan: closed forms, the simulation against them, schedules from real save
policies, the storage forecast against a real store, measured inputs, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import stepvault
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.ops.usage import usage_by_tier
from stepvault.planning import PlanError, plan, plan_json
from stepvault.planning import interval as iv
from stepvault.planning.measure import measure_run
from stepvault.planning.policies import parse_policy
from stepvault.planning.schedule import save_schedule
from stepvault.planning.simulate import simulate
from stepvault.planning.storage import forecast_storage
from stepvault.policy import AtSteps, Every, KeepEvery, KeepLast, LastStep, YoungDaly
from stepvault.store import Store
from stepvault.tiers import CopyEvery, HotLast

DAY = 86400.0


# ------------------------------------------------------------------ closed forms


def test_young_is_sqrt_2cm():
    assert iv.young_interval(60, DAY) == pytest.approx(math.sqrt(2 * 60 * DAY))
    assert iv.young_interval(60, DAY) == pytest.approx(3219.9379, rel=1e-7)


@pytest.mark.parametrize(
    ("delta", "mtbf", "expected"),
    [
        # by hand: x = d/2M; sqrt(2dM) (1 + sqrt(x)/3 + x/9) - d
        (60.0, DAY, 3219.937888 * (1 + math.sqrt(60 / 172800) / 3 + 60 / 172800 / 9) - 60),
        (600.0, 3600.0, math.sqrt(2 * 600 * 3600) * (1 + math.sqrt(1 / 12) / 3 + 1 / 108) - 600),
        (7200.0, 3600.0, 3600.0),  # delta >= 2M: the MTBF
        (
            7199.0,
            3600.0,
            math.sqrt(2 * 7199 * 3600) * (1 + math.sqrt(7199 / 7200) / 3 + 7199 / 7200 / 9) - 7199,
        ),
    ],
)
def test_daly_higher_order_at_chosen_points(delta, mtbf, expected):
    assert iv.daly_interval(delta, mtbf) == pytest.approx(expected, rel=1e-9)


def test_daly_approximates_the_exact_minimum_of_its_wall_time():
    for delta, mtbf in [(10, DAY), (60, DAY), (600, DAY), (300, 3600), (1000, 3600)]:
        taus = np.geomspace(delta / 50, 20 * mtbf, 200_001)
        walls = [iv.daly_wall_time(1.0, t, delta, 0, mtbf) for t in taus[::100]]
        coarse = taus[::100][int(np.argmin(walls))]
        exact = iv.exact_interval(delta, mtbf)
        assert exact == pytest.approx(coarse, rel=0.01)
        # Daly's series is within 0.1 % of the exact optimum up to delta/M ~ 0.01, and its
        # wall time within 0.1 % of the minimum even at delta/M ~ 0.3.
        daly = iv.daly_interval(delta, mtbf)
        walls = [iv.daly_wall_time(1e6, t, delta, 0, mtbf) for t in (daly, exact)]
        assert walls[0] <= walls[1] * 1.001
        if delta / mtbf <= 0.01:
            assert iv.daly_interval(delta, mtbf) == pytest.approx(exact, rel=1e-3)


def test_lambert_w0_and_rto():
    for x in (-1 / math.e, -0.3, -0.1, -1e-6):
        w = iv.lambert_w0(x)
        assert w * math.exp(w) == pytest.approx(x, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError):
        iv.lambert_w0(0.5)
    # A restart much shorter than the MTBF costs about itself; a long one much more.
    assert iv.restart_time_expected(60, DAY) == pytest.approx(60, rel=1e-3)
    assert iv.restart_time_expected(3600, 3600) == pytest.approx(3600 * (math.e - 1))


def test_wall_time_without_failures_is_work_plus_saves():
    segments = [(1000.0, 10.0)] * 5 + [(300.0, 0.0)]
    assert iv.wall_time(segments, 50, 1e15) == pytest.approx(5350, rel=1e-9)
    assert iv.daly_wall_time(5000, 1000, 10, 50, 1e15) == pytest.approx(5050, rel=1e-9)


# ------------------------------------------------------------------ simulation


def _uniform(work: float, tau: float, delta: float) -> list[tuple[float, float]]:
    n = int(work // tau)
    segments = [(tau, delta)] * n
    if work - n * tau > 1e-9:
        segments.append((work - n * tau, delta))
    return segments


@pytest.mark.parametrize(
    ("delta", "restart", "factor", "work"),
    [
        (60, 300, 1.0, 30 * DAY),  # typical: 1 min saves, 5 min restarts, MTBF 1 day
        (600, 600, 1.0, 30 * DAY),
        (60, 0, 4.0, 10 * DAY),  # saving 4x too rarely
        (60, 300, 0.25, 10 * DAY),  # 4x too often
        (3000, 3000, 0.5, 60 * DAY),  # delta/M ~ 3.5 %: ETTR ~ 0.7
        (60, 300, 1.0, 1 * DAY),  # a run as long as the MTBF
    ],
)
def test_simulated_ettr_agrees_with_daly_within_2_percent(delta, restart, factor, work):
    tau = iv.daly_interval(delta, DAY) * factor
    segments = _uniform(work, tau, delta)
    analytic = work / iv.wall_time(segments, restart, DAY)
    result = simulate(segments, restart=restart, mtbf=DAY, trials=1000, seed=7)
    assert abs(result.ettr / analytic - 1) < 0.02
    assert abs(result.ettr - analytic) < 5 * result.ettr_se + 1e-4  # and statistically
    # Failures over wall time: a Poisson process (Wald: E[N] = E[T_w] / M).
    assert result.failures_mean == pytest.approx(result.wall_mean / DAY, rel=0.1)


def test_simulation_is_seeded():
    segments = _uniform(5 * DAY, 3000, 60)
    a = simulate(segments, restart=100, mtbf=DAY, trials=200, seed=3)
    b = simulate(segments, restart=100, mtbf=DAY, trials=200, seed=3)
    c = simulate(segments, restart=100, mtbf=DAY, trials=200, seed=4)
    assert a == b and a.wall_mean != c.wall_mean


def test_async_commit_delay_costs_little_while_it_is_small_against_the_mtbf():
    segments = _uniform(20 * DAY, 3000, 5)
    sync = simulate(segments, restart=120, mtbf=DAY, trials=1000, seed=1)
    late = simulate(segments, restart=120, mtbf=DAY, trials=1000, seed=1, commit_delay=300)
    analytic = 20 * DAY / iv.wall_time(segments, 120, DAY)
    # A save committed 300 s after it started can be lost with its segment: ETTR drops by
    # about (300 - 5) / M = 0.34 %, still within 2 % of the closed form with delta = stall.
    assert late.ettr < sync.ettr
    assert abs(late.ettr / analytic - 1) < 0.02


def test_weibull_shape_one_is_exponential_and_shape_below_one_differs():
    segments = _uniform(30 * DAY, iv.daly_interval(60, DAY), 60)
    expo = simulate(segments, restart=300, mtbf=DAY, trials=1000, seed=2)
    k1 = simulate(
        segments,
        restart=300,
        mtbf=DAY,
        trials=1000,
        seed=2,
        distribution="weibull",
        weibull_shape=1.0,
    )
    k07 = simulate(
        segments,
        restart=300,
        mtbf=DAY,
        trials=1000,
        seed=2,
        distribution="weibull",
        weibull_shape=0.7,
    )
    assert abs(k1.ettr - expo.ettr) < 4 * math.hypot(k1.ettr_se, expo.ettr_se)
    # Same mean time between failures (a renewal process: E[N] ~ T_w / M whatever the
    # shape), but burstier failures (k < 1: many short gaps, a few long ones) spread the
    # run's length more widely.
    assert k07.failures_mean == pytest.approx(k07.wall_mean / DAY, rel=0.05)
    assert k07.wall_se > 1.1 * expo.wall_se
    with pytest.raises(PlanError, match="--weibull-shape"):
        simulate(segments, restart=0, mtbf=DAY, distribution="weibull", weibull_shape=-1)


# ------------------------------------------------------------------ schedules


def test_schedule_drives_the_real_policies():
    s = save_schedule(
        Every(steps=7) | AtSteps(3) | LastStep(), total_steps=30, step_time=2, save_cost=1
    )
    assert s.steps == [3, 7, 14, 21, 28, 30]
    assert s.points[1].wall == pytest.approx(7 * 2 + 1)  # one save (at 3) before it
    t = save_schedule(Every(seconds=10), total_steps=30, step_time=2, save_cost=0)
    assert t.steps == [6, 11, 16, 21, 26]  # the first boundary arms the timer (at 2 s)
    yd = YoungDaly(1, min_seconds=0)
    y = save_schedule(yd, total_steps=1000, step_time=1, save_cost=2)
    gaps = np.diff(y.steps)
    # sqrt(2 * 2 s * 3600 s) = 120 s of wall clock between saves, of which 2 s are the stall
    assert yd.interval(2.0) == pytest.approx(120)
    assert set(gaps[1:].tolist()) == {118}
    assert str(yd) == "YoungDaly(1, min_seconds=0)"  # the caller's object was not driven
    weights = save_schedule(
        Every(steps=5, what="weights") | Every(steps=10), total_steps=20, step_time=1, save_cost=1
    )
    # only full saves start a segment; a weights save's stall is part of the next one
    assert weights.segments() == [(11.0, 1.0), (11.0, 1.0)]


def test_policies_from_text_are_the_real_objects_and_nothing_else():
    keep = parse_policy("KeepLast(3) | KeepEvery(steps=1000)", "--keep")
    assert keep == KeepLast(3) | KeepEvery(steps=1000)
    assert repr(parse_policy("HotLast(3) | CopyEvery('archive', steps=5)", "--tiers")) == repr(
        HotLast(3) | CopyEvery("archive", steps=5)
    )
    for bad, match in [
        ("__import__('os').system('true')", "not a policy"),
        ("KeepLast(len('abc'))", "not a literal"),
        ("Every(steps=10)", "unknown policy 'Every'"),
        ("KeepLast(0)", "positive integer"),
        ("KeepLast(3", "cannot parse"),
        ("KeepLast(**{'n': 3})", "kwargs"),
    ]:
        with pytest.raises(PlanError, match=match):
            parse_policy(bad, "--keep")


# ------------------------------------------------------------------ a real run


def _train(root, *, total=100, keep=None, tier_policy=None, tiers=None, run="r"):
    """A real manager run: a frozen 1.4 MB layer (stored once) and a small trained head."""
    torch.manual_seed(0)
    frozen = torch.nn.Linear(600, 600)
    frozen.requires_grad_(False)
    head = torch.nn.Linear(600, 16)
    model = torch.nn.Sequential(frozen, head)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt, "step": 0}
    mgr = stepvault.CheckpointManager(
        root,
        run=run,
        save=Every(steps=5),
        keep=keep,
        async_save=False,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
        tiers=tiers,
        tier_policy=tier_policy,
    )
    x = torch.randn(8, 600)
    for step in range(total):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step + 1
        if mgr.save(step + 1, state) is not None and mgr.tier_mover is not None:
            # The forecast assumes each mover pass ends before the next save; wait for it
            # here so the real sequence is that one (in training it runs in the background).
            mgr.tier_mover.drain()
    mgr.close()
    return state


def test_storage_forecast_equals_the_real_store(tmp_path):
    root, archive = tmp_path / "hot", tmp_path / "archive"
    keep = KeepLast(3) | KeepEvery(steps=25)
    tier_policy = HotLast(2) | CopyEvery("archive", steps=10)
    _train(root, keep=keep, tier_policy=tier_policy, tiers={"archive": str(archive)})
    store = Store.open(root)
    measured = measure_run(store, "r")
    assert measured.saves == 20 and measured.save_every_steps == 5
    stored, new = measured.sizes["full"]
    assert stored > 1_400_000 and new < stored / 10  # the frozen layer is shared

    schedule = save_schedule(Every(steps=5), total_steps=100, step_time=0.01, save_cost=0.01)
    forecast = forecast_storage(schedule, sizes=measured.sizes, keep=keep, tiers=tier_policy)
    by_tier = usage_by_tier(store)
    from stepvault.tiers import Tiers

    tiers = Tiers.of(store)
    assert forecast.tiers["hot"].steps == store.list_steps("r")
    assert forecast.tiers["archive"].steps == tiers["archive"].list_steps("r")
    assert forecast.tiers["archive"].steps == list(range(10, 101, 10))
    for tier in ("hot", "archive"):
        real = by_tier[tier].runs[0].unique_stored_bytes
        assert forecast.tiers[tier].bytes_end == pytest.approx(real, rel=0.01), tier


def test_storage_forecast_of_a_keep_policy_alone_matches_retention(tmp_path):
    keep = KeepLast(3) | KeepEvery(steps=25)
    _train(tmp_path, keep=keep)
    store = Store.open(tmp_path)
    sizes = measure_run(store, "r").sizes
    schedule = save_schedule(Every(steps=5), total_steps=100, step_time=1, save_cost=0)
    forecast = forecast_storage(schedule, sizes=sizes, keep=keep, prices={"hot": 0.1})
    assert forecast.tiers["hot"].steps == store.list_steps("r") == [25, 50, 75, 90, 95, 100]
    real = stepvault.ops.usage(tmp_path).runs[0].unique_stored_bytes
    assert forecast.tiers["hot"].bytes_end == pytest.approx(real, rel=0.01)
    assert forecast.deleted == 20 - 6
    assert forecast.tiers["hot"].cost_run > 0


def test_plan_of_a_measured_run(tmp_path):
    state = _train(tmp_path, total=40)
    mgr = stepvault.CheckpointManager(tmp_path, run="r")
    assert mgr.restore(state).step == 40
    mgr.close()
    p = plan(tmp_path, "r", mtbf="24h", total_steps=100_000, keep="KeepLast(3)")
    doc = p.to_json()
    assert doc["inputs"]["save_cost_seconds"]["source"].startswith("measured")
    assert doc["inputs"]["restore_seconds"]["source"].startswith("measured")
    assert doc["inputs"]["step_time_seconds"]["source"].startswith("measured")
    assert doc["inputs"]["save_policy"]["value"] == "Every(steps=5)"
    assert doc["interval"]["daly_steps"] > 5  # saves that cheap belong much rarer
    assert doc["goodput"]["optimum"]["ettr"] >= doc["goodput"]["current"]["ettr"]
    assert doc["storage"]["tiers"]["hot"]["checkpoints_end"] == 3
    assert plan_json(tmp_path, "r", mtbf="24h", total_steps=1000)["run"] == "r"


def test_a_run_without_a_measured_save_names_the_option(tmp_path):
    stepvault.save(tmp_path, {"model": torch.nn.Linear(2, 2)}, run="plain", step=1)
    with pytest.raises(PlanError, match="--save-cost"):
        plan(tmp_path, "plain", mtbf="24h", total_steps=100)
    doc = plan_json(tmp_path, "plain", mtbf="24h", total_steps=100)
    assert "--save-cost" in doc["error"]
    p = plan(
        tmp_path, "plain", mtbf="24h", total_steps=100, save_cost=1, step_time=1, simulate_trials=0
    )
    assert p.storage is not None  # sizes from the listing
    with pytest.raises(PlanError, match="no events and no checkpoints"):
        plan(tmp_path, "nosuch", mtbf="24h", total_steps=100, save_cost=1)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mtbf": 0}, "--mtbf"),
        ({"mtbf": "-3h"}, "--mtbf must not be negative"),
        ({"mtbf": None}, "--mtbf 24h, or --nodes"),
        ({"save_cost": 0}, "--save-cost"),
        ({"step_time": "0s"}, "--step-time"),
        ({"total_steps": 0}, "--total-steps"),
        ({"size": "-1GB"}, "--size"),
        ({"size": "1GB", "new_size": "2GB"}, "--new-size"),
        ({"size": "1GB", "prices": ["hot=-0.1/GB-month"]}, "--price hot"),
        ({"size": "1GB", "prices": ["hot=0.1/GB-week"]}, "unknown unit"),
        ({"keep": "KeepLast(3)"}, "--size 14GB"),
        ({"save": "Every(steps=0)"}, "--save"),
        ({"nodes": 0, "node_mtbf": "5y", "mtbf": None}, "--nodes"),
    ],
)
def test_bad_input_is_an_error_naming_the_option(options, match):
    args = {
        "mtbf": "24h",
        "save_cost": 60,
        "step_time": 1,
        "total_steps": 1000,
        "simulate_trials": 0,
        **options,
    }
    with pytest.raises(PlanError, match=match):
        plan(**args)


def test_interval_longer_than_the_run_is_a_stated_assumption():
    p = plan(
        mtbf="30d",
        save_cost=600,
        step_time=1,
        total_steps=3600,
        save="Every(steps=10000)",
        simulate_trials=100,
    )
    text = " ".join(p.assumptions)
    assert "longer than the run" in text and "never saves within the run" in text
    assert p.optimum.saves == 0 and p.current.saves == 0
    # No save: a failure costs the whole run so far, and the closed form still holds.
    assert p.optimum.simulated["ettr"] == pytest.approx(p.optimum.ettr, rel=0.02)


def test_nodes_times_node_mtbf_and_prices():
    p = plan(
        nodes=365,
        node_mtbf="1y",
        save_cost=30,
        step_time=1,
        total_steps=10_000,
        size="10GB",
        prices=["hot=0.05/GB-month"],
        simulate_trials=0,
    )
    assert p.inputs["mtbf_seconds"]["value"] == pytest.approx(DAY)
    hot = p.storage.tiers["hot"]
    assert hot.price_per_gb_month == 0.05
    # no keep policy: every checkpoint stays; the bill integrates what was held over time
    assert len(hot.steps) == p.optimum.saves
    assert hot.cost_run == pytest.approx(hot.byte_hours / 1e9 / 730 * 0.05)


@pytest.mark.slow
def test_simulation_agrees_with_daly_over_the_documented_range():
    from stepvault.planning.validation import GRID, validation_grid

    # Every point of the documented range but the longest runs (T_s = 50 M, a third of the
    # CI time of this test); each point's simulation is seeded alike, so these rows are the
    # same as in the full grid, which `benchmarks/plan_validation.py` runs (PLANNING.md).
    grid = {**GRID, "length": tuple(x for x in GRID["length"] if x <= 10.0)}
    rows = list(validation_grid(trials=1000, seed=0, grid=grid))
    assert len(rows) > 150
    worst = max(rows, key=lambda r: abs(r["relative_difference"]))
    assert abs(worst["relative_difference"]) < 0.02, worst


def test_async_commit_longer_than_the_interval_is_stated():
    p = plan(
        mtbf="24h",
        save_cost=1,
        write_time=900,
        step_time=1,
        total_steps=20_000,
        save="Every(steps=300)",
        simulate_trials=200,
    )
    assert any("longer than the interval" in a for a in p.assumptions)
    # the waits are real: the simulation sees them, the closed form does not
    assert p.current.simulated["ettr"] < p.current.ettr * 0.98


def test_weibull_plans_size_factors_and_epoch_rules():
    p = plan(
        mtbf="24h",
        save_cost=60,
        step_time=2,
        total_steps=100_000,
        simulate_trials=200,
        failures="weibull",
        weibull_shape=0.7,
        save="Every(steps=2000)",
        size="10GB",
        new_size="8GB",
        tiers="HotLast(1) | CopyEvery('archive', steps=10000)",
        size_factors={"archive": 0.5},
    )
    assert p.optimum.simulated["distribution"] == "weibull"
    assert any("assume exponential failures" in a for a in p.assumptions)
    archive = p.storage.tiers["archive"]
    assert archive.steps == list(range(10_000, 100_001, 10_000))
    assert archive.bytes_end == 0.5 * (2e9 + 10 * 8e9)  # the tier's codec halves its bytes
    with pytest.raises(PlanError, match="--steps-per-epoch"):
        plan(mtbf="24h", save_cost=60, step_time=2, total_steps=1000, save="Every(epochs=1)")
    e = plan(
        mtbf="24h",
        save_cost=60,
        step_time=2,
        total_steps=1000,
        save="Every(epochs=1)",
        steps_per_epoch=250,
        simulate_trials=0,
    )
    assert e.current.saves == 4


def test_long_runs_of_step_policies_are_fast_and_too_many_saves_is_an_error():
    long = save_schedule(Every(steps=1000), total_steps=50_000_000, step_time=1, save_cost=1)
    assert len(long.points) == 50_000  # beyond MAX_STEPS: only the steps it can fire at
    with pytest.raises(PlanError, match="--total-steps"):
        save_schedule(Every(seconds=10), total_steps=50_000_000, step_time=1, save_cost=1)
    with pytest.raises(PlanError, match="saves more than"):
        save_schedule(Every(steps=2), total_steps=10_000_000, step_time=1, save_cost=1)
