"""The documented range where the simulation and the closed form agree (PLANNING.md).

:func:`validation_grid` plays the Monte Carlo of :mod:`.simulate` against Daly's expected
wall time over a grid of parameters; ``benchmarks/plan_validation.py`` prints it as the
table in PLANNING.md and a slow test asserts the 2 % bound over all of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from . import interval as iv
from .simulate import simulate

__all__ = ["GRID", "validation_grid"]

MTBF = 86400.0  # the unit: every other parameter is a ratio to it

#: The documented range: save cost / MTBF, restart / MTBF, interval / Daly's optimum,
#: run length / MTBF, and the commit delay of an asynchronous save / MTBF (0: synchronous).
GRID: dict[str, tuple[float, ...]] = {
    "delta": (1e-4, 1e-3, 1e-2, 5e-2),
    "restart": (0.0, 1e-3, 1e-2, 5e-2),
    "interval": (0.25, 1.0, 4.0),
    "length": (1.0, 10.0, 50.0),
    "commit": (0.0, 5e-3),
}


def _segments(work: float, tau: float, delta: float) -> list[tuple[float, float]]:
    n = int(work // tau)
    out = [(tau, delta)] * n
    if work - n * tau > 1e-9 * work:
        out.append((work - n * tau, delta))
    return out


def validation_grid(
    *,
    trials: int = 1000,
    seed: int = 0,
    grid: dict[str, tuple[float, ...]] | None = None,
    distribution: str = "exponential",
    weibull_shape: float | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per grid point: the parameters (as ratios to the MTBF), the closed-form and
    simulated ETTR, their relative difference and the simulation's standard error.
    Outside the range, and left out: points whose interval plus save cost exceeds the MTBF
    (a run's length is then dominated by rare long failure-free stretches, and the mean of a
    thousand trials does not settle within 2 %), and asynchronous saves that take longer to
    commit than the interval (each save then waits for the one before, a cost the closed
    form with the stall as save cost does not see; the plan says so when it happens)."""
    g = grid or GRID
    keys = ("delta", "restart", "interval", "length", "commit")
    for delta, restart, factor, length, commit in itertools.product(*(g[k] for k in keys)):
        d = delta * MTBF
        tau = iv.daly_interval(d, MTBF) * factor
        if tau + d > MTBF or commit * MTBF > tau:
            continue
        work = length * MTBF
        segments = _segments(work, tau, d)
        analytic = work / iv.wall_time(segments, restart * MTBF, MTBF)
        cd = max(commit * MTBF, d) if commit else None
        result = simulate(
            segments,
            restart=restart * MTBF,
            mtbf=MTBF,
            trials=trials,
            seed=seed,
            commit_delay=cd,
            distribution=distribution,  # type: ignore[arg-type]
            weibull_shape=weibull_shape,
        )
        yield {
            "delta/M": delta,
            "R/M": restart,
            "tau/tau_daly": factor,
            "T_s/M": length,
            "W/M": commit,
            "saves": len(segments),
            "ettr_analytic": analytic,
            "ettr_simulated": result.ettr,
            "ettr_se": result.ettr_se,
            "relative_difference": result.ettr / analytic - 1.0,
            "trials": result.trials,
        }
