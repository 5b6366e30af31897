"""Monte Carlo of a run with failures: the check on the closed forms of :mod:`.interval`.

Each trial plays a run through its save schedule on a wall clock: training advances the
run's progress; at each save training stalls for the save cost; the save commits at the
end of the stall (synchronous) or ``commit_delay`` seconds after it started (asynchronous:
the write goes on in the background while training continues, and a later save waits for
it, as ``if_busy="wait"`` does). A failure (exponential or Weibull times between failures,
a renewal process: each failure starts a fresh draw) rolls progress back to the newest
*committed* save, drops a save still in flight, and costs a restart, which may itself be
hit by the next failure. The run is done when its progress reaches the end and its last
save, if any, is committed.

The trials run together as numpy arrays, one event per trial per iteration, so the cost is
(events per trial) x (a few array operations). It is bounded: a run the closed form expects
to need more events (failures, restarts, saves) than ``max_events`` allows, and a trial that
still goes on after twice its share of them, raise :class:`SimulationTooLong` rather than
spin (a save cost of many MTBFs: a save almost never completes before the next failure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..errors import SimulationTooLong
from .interval import wall_time
from .units import PlanError

__all__ = ["SimulationResult", "SimulationTooLong", "simulate"]

Distribution = Literal["exponential", "weibull"]


@dataclass(frozen=True)
class SimulationResult:
    """Means over ``trials`` runs; ``*_se`` are standard errors of the mean."""

    trials: int
    seed: int
    distribution: str
    weibull_shape: float | None
    work: float  # useful compute seconds (ETTR's numerator)
    wall_mean: float
    wall_se: float
    failures_mean: float
    restart_mean: float
    save_time: float

    @property
    def ettr(self) -> float:
        """Useful work over expected wall time (the same ratio the closed form gives)."""
        return self.work / self.wall_mean

    @property
    def ettr_se(self) -> float:
        return self.ettr * self.wall_se / self.wall_mean

    def to_json(self) -> dict[str, Any]:
        lost = self.wall_mean - self.work - self.save_time - self.restart_mean
        return {
            "trials": self.trials,
            "seed": self.seed,
            "distribution": self.distribution,
            "weibull_shape": self.weibull_shape,
            "ettr": self.ettr,
            "ettr_se": self.ettr_se,
            "wall_seconds": self.wall_mean,
            "wall_seconds_se": self.wall_se,
            "failures": self.failures_mean,
            "restart_seconds": self.restart_mean,
            "save_seconds": self.save_time,
            "lost_seconds": lost,
        }


def _events_per_trial(segments: list[tuple[float, float]], restart: float, mtbf: float) -> float:
    """What one trial is expected to take, generously: up to 4 events per save (its stall,
    a wait, its commit) and 12 per failure (the failure, the restart, the segment redone),
    the failures being the closed form's ``T_w / M`` (``inf`` if that overflows)."""
    return 4.0 * len(segments) + 12.0 * wall_time(segments, restart, mtbf) / mtbf


def _too_long(segments: list[tuple[float, float]], restart: float, mtbf: float) -> str:
    wall = wall_time(segments, restart, mtbf)
    if not math.isfinite(wall):
        return (
            "the closed form's expected wall time exceeds 1e308 s (the run is not expected to end)"
        )
    work = sum(w for w, _ in segments)
    return (
        f"the closed form expects {wall / mtbf:.3g} failures over the run (ETTR {work / wall:.3g})"
    )


def _sampler(rng: np.random.Generator, mtbf: float, distribution: str, shape: float | None):
    if distribution == "exponential":
        return lambda n: rng.exponential(mtbf, n)
    if distribution == "weibull":
        if shape is None or not math.isfinite(shape) or shape <= 0:
            raise PlanError(f"--weibull-shape must be a positive number, got {shape!r}")
        scale = mtbf / math.gamma(1.0 + 1.0 / shape)  # so that the mean is the MTBF
        return lambda n: scale * rng.weibull(shape, n)
    raise PlanError(f"--failures must be 'exponential' or 'weibull', got {distribution!r}")


def simulate(
    segments: list[tuple[float, float]],
    *,
    restart: float,
    mtbf: float,
    commit_delay: float | None = None,
    trials: int = 2000,
    seed: int = 0,
    distribution: Distribution = "exponential",
    weibull_shape: float | None = None,
    max_events: int = 50_000_000,
    useful: float | None = None,
) -> SimulationResult:
    """Play ``trials`` runs of ``segments`` (``(compute seconds, save cost)``, as
    :meth:`.Schedule.segments` gives them) with random failures of mean ``mtbf``.

    ``commit_delay``: seconds from the start of a save until it is committed (None: at the
    end of its stall, a synchronous save). ``max_events`` bounds iterations x trials; the
    trial count is lowered to fit the events the closed form expects per trial (never below
    100) and the result says how many ran. Raises :class:`SimulationTooLong` when even 100
    trials do not fit, or when a trial is still running after ``2 * max_events / trials``
    iterations (so it ends, whatever the failures).
    ``useful``: the compute seconds that count as progress (default: all segment work;
    a plan excludes the cost of weights-only saves, which segments carry as work).
    """
    if not segments:
        raise PlanError("nothing to simulate: the run has no steps (--total-steps)")
    if trials < 1:
        raise PlanError(f"--trials must be at least 1, got {trials}")
    n_seg = len(segments)
    per_trial = _events_per_trial(segments, restart, mtbf)
    floor = min(trials, 100)
    if floor * per_trial > max_events:
        raise SimulationTooLong(
            f"{_too_long(segments, restart, mtbf)}: simulating {floor} runs would take more "
            f"than {max_events:,} events"
        )
    trials = max(min(trials, int(max_events // per_trial)), floor)
    max_iterations = 2 * max_events // trials
    rng = np.random.default_rng(seed)
    draw = _sampler(rng, mtbf, distribution, weibull_shape)

    work = np.array([w for w, _ in segments], dtype=float)
    cost = np.array([c for _, c in segments], dtype=float)
    ends = np.cumsum(work)  # progress at which save k starts
    starts = np.concatenate(([0.0], ends))  # progress after commit k-1 (index k)
    delay = cost.copy() if commit_delay is None else np.maximum(cost, float(commit_delay))
    delay[cost == 0] = 0.0  # the end of a run without a save commits nothing
    inf = math.inf

    t = np.zeros(trials)
    pos = np.zeros(trials)
    k = np.zeros(trials, dtype=np.int64)  # segment being worked on
    committed = np.full(trials, -1, dtype=np.int64)  # newest committed segment
    pending = np.full(trials, -1, dtype=np.int64)
    pending_at = np.full(trials, inf)
    restarting = np.zeros(trials, dtype=bool)
    ready_at = np.zeros(trials)
    next_fail = draw(trials)
    failures = np.zeros(trials)
    restart_time = np.zeros(trials)
    active = np.ones(trials, dtype=bool)
    kk = np.minimum(k, n_seg - 1)

    iterations = 0
    while active.any():
        iterations += 1
        if iterations > max_iterations:
            raise SimulationTooLong(
                f"a simulated run took more than {max_iterations:,} events (failures, restarts, "
                f"saves); {_too_long(segments, restart, mtbf)}"
            )
        kk = np.minimum(k, n_seg - 1)
        has_pending = pending >= 0
        # Training: the stall of save k ends at max(arrival, previous commit) + cost.
        reach = t + (ends[kk] - pos)
        stall_end = np.maximum(reach, np.where(has_pending, pending_at, -inf)) + cost[kk]
        end = np.where(k < n_seg, stall_end, inf)
        end = np.where(restarting, ready_at, end)
        commit = np.where(has_pending & ~restarting, pending_at, inf)
        first = np.minimum(end, commit)
        fail = active & (next_fail < first)
        commits = active & ~fail & (commit <= end)
        moves = active & ~fail & ~commits

        # A failure: back to the newest committed save; a save in flight is lost.
        if fail.any():
            f = fail
            restart_time[f & restarting] += next_fail[f & restarting] - t[f & restarting]
            t[f] = next_fail[f]
            failures[f] += 1
            pending[f] = -1
            pending_at[f] = inf
            k[f] = committed[f] + 1
            pos[f] = starts[k[f]]
            restarting[f] = True
            ready_at[f] = t[f] + restart
            next_fail[f] = t[f] + draw(int(f.sum()))

        if commits.any():
            c = commits
            pos[c] = np.minimum(pos[c] + (commit[c] - t[c]), ends[kk[c]])
            t[c] = commit[c]
            committed[c] = pending[c]
            pending[c] = -1
            pending_at[c] = inf

        if moves.any():
            r = moves & restarting  # restart finished: training runs again
            restart_time[r] += ready_at[r] - t[r]
            t[r] = ready_at[r]
            restarting[r] = False
            s = moves & ~r  # save k's stall is over (or the run's end is reached)
            t[s] = end[s]
            pos[s] = ends[kk[s]]
            saved = s & (cost[kk] > 0)
            sync = saved & (delay[kk] <= cost[kk])
            committed[sync] = k[sync]
            later = saved & ~sync
            pending[later] = k[later]
            pending_at[later] = end[later] - cost[kk[later]] + delay[kk[later]]
            k[s] += 1

        active = (k < n_seg) | (pending >= 0) | restarting

    total_work = float(work.sum()) if useful is None else float(useful)
    wall = t
    se = float(wall.std(ddof=1) / math.sqrt(trials)) if trials > 1 else inf
    return SimulationResult(
        trials=trials,
        seed=seed,
        distribution=distribution,
        weibull_shape=weibull_shape if distribution == "weibull" else None,
        work=total_work,
        wall_mean=float(wall.mean()),
        wall_se=se,
        failures_mean=float(failures.mean()),
        restart_mean=float(restart_time.mean()),
        save_time=float(cost.sum()),
    )
