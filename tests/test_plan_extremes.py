"""``stepvault plan`` at the ends of its inputs: a save cost of many MTBFs (the simulation
must end and the plan say checkpointing cannot keep up) and a vanishing one (the exact
interval must not cancel to 0). Every call that could spin runs under a watchdog or in a
process with a timeout, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from stepvault.planning import interval as iv
from stepvault.planning import plan

HOUR = 3600.0
HOPELESS = ["--save-cost", "1e5", "--mtbf", "1h", "--step-time", "1", "--total-steps", "100000"]
CANNOT_KEEP_UP = "checkpointing cannot keep up with these failures"

_CLI = (
    "import sys; from stepvault.cli.main import main; "
    "sys.argv = ['stepvault', *sys.argv[1:]]; main()"
)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``stepvault *args`` in a new process; TimeoutExpired (a failure) if it spins."""
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-c", _CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Fail the test (rather than hang) when the block runs longer than ``seconds``."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: unbounded")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_save_cost_of_many_mtbfs_plans_promptly_and_says_it_cannot_keep_up():
    proc = _cli("plan", *HOPELESS)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert CANNOT_KEEP_UP in out
    assert "no simulation of Every(steps=3600): the closed form expects 9.84e+25 failures" in out
    assert "the closed form stands alone" in out


def test_the_hopeless_plan_in_json_has_no_simulated_figures_and_says_why():
    with watchdog(20):
        p = plan(mtbf="1h", save_cost=1e5, step_time=1, total_steps=100_000)
    assert p.optimum.simulated is None
    assert p.optimum.ettr < 1e-20
    assert p.optimum.failures == pytest.approx(9.84e25, rel=1e-3)
    assert any(CANNOT_KEEP_UP in a for a in p.assumptions)
    skipped = [a for a in p.assumptions if a.startswith("no simulation of Every(steps=3600)")]
    assert len(skipped) == 1 and "failures over the run" in skipped[0]


def test_simulate_refuses_a_run_it_cannot_finish_instead_of_spinning():
    from stepvault.planning.simulate import SimulationTooLong, simulate

    segments = [(HOUR, 1e5)] * 27 + [(2800.0, 0.0)]
    with watchdog(20), pytest.raises(SimulationTooLong, match="failures over the run"):
        simulate(segments, restart=1e5, mtbf=HOUR, trials=1000)
    # A save cost that overflows the closed form (e^(delta/M) > 1e308) too.
    with watchdog(20), pytest.raises(SimulationTooLong, match="exceeds 1e308 s"):
        simulate([(HOUR, 1e9)], restart=0.0, mtbf=HOUR, trials=10)


def test_simulate_stops_a_trial_that_outruns_the_closed_form():
    # Weibull failures of shape 0.1 (mean = MTBF) come in bursts far denser than the
    # exponential estimate the trial count is sized by: the cap on iterations ends it.
    from stepvault.planning.simulate import SimulationTooLong, simulate

    with watchdog(20), pytest.raises(SimulationTooLong, match="took more than 50 events"):
        simulate(
            [(HOUR / 2, HOUR / 2)],
            restart=0.0,
            mtbf=HOUR,
            trials=100,
            max_events=2500,
            distribution="weibull",
            weibull_shape=0.1,
        )


def test_a_save_cost_that_underflows_the_exact_interval_is_the_too_large_statement():
    proc = _cli("plan", "--save-cost", "1e9", "--mtbf", "1h")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "lambert" not in out + proc.stderr
    assert "the save cost is at least twice the MTBF" in out and CANNOT_KEEP_UP in out
    assert "exact optimum 60.0 min" in out
    doc = json.loads(_cli("plan", "--save-cost", "1e9", "--mtbf", "1h", "--json").stdout)
    assert doc["interval"]["exact_seconds"] == HOUR == doc["interval"]["daly_seconds"]


def test_a_full_plan_with_a_save_cost_beyond_float_range_is_stated_not_an_error():
    with watchdog(20):
        p = plan(mtbf="1h", save_cost=1e9, step_time=1, total_steps=100_000)
    assert p.interval["exact_seconds"] == HOUR
    assert p.optimum.ettr == 0.0 and p.optimum.wall_seconds == math.inf
    assert not math.isnan(p.optimum.lost_seconds) and p.optimum.simulated is None
    assert any(CANNOT_KEEP_UP in a for a in p.assumptions)
    assert any("exceeds 1e308 s" in a for a in p.assumptions)


@pytest.mark.parametrize("delta", [1e9, 1e6, 1e4, 3000.0])
def test_exact_interval_for_large_save_costs_tends_to_the_mtbf(delta):
    tau = iv.exact_interval(delta, HOUR)
    assert 0 < tau <= HOUR
    y = tau / HOUR  # the optimum solves delta/M = -y - log(1 - y)
    if y < 1:
        assert -y - math.log1p(-y) == pytest.approx(delta / HOUR, rel=1e-9)
    assert iv.lambert_w0(-0.0) == 0.0 == iv.lambert_w0(0.0)


@pytest.mark.parametrize("delta", [1e-300, 1e-100, 1e-20, 1e-12])
def test_exact_interval_for_tiny_save_costs_is_youngs(delta):
    exact = iv.exact_interval(delta, HOUR)
    assert exact == pytest.approx(iv.young_interval(delta, HOUR), rel=1e-5, abs=0)
    assert exact == pytest.approx(iv.daly_interval(delta, HOUR), rel=1e-5, abs=0)
    assert 0 < exact <= iv.young_interval(delta, HOUR) * (1 + 1e-15)  # Young minus O(delta)


def test_tiny_save_cost_on_the_command_line_prints_the_exact_optimum():
    proc = _cli("plan", "--save-cost", "1e-300", "--mtbf", "24h", "--json")
    assert proc.returncode == 0, proc.stderr
    interval = json.loads(proc.stdout)["interval"]
    exact = interval["exact_seconds"]
    assert exact == pytest.approx(4.1569219381653e-148, rel=1e-12, abs=0)  # was 0
    assert exact == pytest.approx(interval["daly_seconds"], rel=1e-12, abs=0)


def test_exact_interval_solves_its_equation_for_small_ratios_and_across_the_switch():
    # The series of 1 + W0 at the branch point takes over from W0 at p = 1e-2, i.e.
    # delta/M = -log(1 - p^2/2) ~ 5e-5: on either side the optimum solves its equation
    # (1 + W0(x) cancelled: delta/M = 1e-12 was 2.4e-5 off).
    for ratio in (1e-12, 1e-9, 1e-6, 4.9e-5, 4.99999e-5, 5.00001e-5, 5.1e-5, 1e-3):
        y = iv.exact_interval(ratio * HOUR, HOUR) / HOUR
        series = sum(y**n / n for n in range(2, 12))  # -y - log(1 - y), without cancelling
        assert series == pytest.approx(ratio, rel=1e-10, abs=0)
    lo = iv.exact_interval(4.99999e-5 * HOUR, HOUR)
    hi = iv.exact_interval(5.00001e-5 * HOUR, HOUR)
    # tau ~ sqrt(2 delta M): a relative step of 4e-6 in delta moves it by ~2e-6, no jump
    assert (hi - lo) / lo == pytest.approx(2e-6, rel=0.01)
