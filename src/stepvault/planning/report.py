"""``stepvault.planning.plan``: interval, goodput, RPO/RTO and storage bill for a run or a job.

Every input is either measured (from the run's events and listing, :mod:`.measure`),
given, or assumed; the plan lists which, and every assumption in words.

(Longer than most modules: the one function that assembles a plan and its table and JSON
views; the formulas, simulation and storage forecast live in their own modules.)
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import interval as iv
from .policies import parse_policy
from .schedule import Schedule, every_steps, save_schedule
from .simulate import SimulationTooLong, simulate
from .storage import StorageForecast, forecast_storage
from .units import PlanError, parse_duration, parse_price, parse_size, positive

__all__ = ["DEFAULT_PRICES", "Goodput", "Plan", "plan", "plan_json"]

#: Example prices in dollars per GB-month, applied to tiers of these names unless --price says
#: otherwise. Rough public list prices (block SSD, object storage standard class, archive
#: class) — examples to be replaced by your own, not truths.
DEFAULT_PRICES: dict[str, float] = {"hot": 0.10, "archive": 0.023, "cold": 0.004}

#: The simulation advances every trial one event per iteration: beyond this many saves in
#: the run it would take minutes, and the plan says it was skipped instead.
SIMULATION_MAX_SAVES = 20_000

#: Seconds or a duration string ("24h").
Duration = float | str


@dataclass
class Goodput:
    """The expected cost of one save schedule (closed form; ``simulated`` when run)."""

    label: str
    policy: str
    saves: int
    interval_seconds: float | None  # mean compute between full saves
    interval_steps: float | None
    wall_seconds: float
    useful_seconds: float
    save_seconds: float
    restart_seconds: float
    lost_seconds: float
    failures: float
    rpo_seconds: float
    rpo_steps: float
    simulated: dict[str, Any] | None = None

    @property
    def ettr(self) -> float:
        return self.useful_seconds / self.wall_seconds

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["ettr"] = self.ettr
        if self.simulated is not None:
            sim = self.simulated
            out["simulated"] = {**sim, "relative_difference": sim["ettr"] / self.ettr - 1.0}
        return out


@dataclass
class Plan:
    """A plan: :meth:`to_json` is what ``stepvault plan --json`` prints."""

    run: str | None
    inputs: dict[str, dict[str, Any]]
    interval: dict[str, Any]
    optimum: Goodput
    current: Goodput | None
    rto_seconds: float
    storage: StorageForecast | None
    assumptions: list[str] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "stepvault-plan/1",
            "run": self.run,
            "inputs": self.inputs,
            "interval": self.interval,
            "goodput": {
                "optimum": self.optimum.to_json(),
                "current": None if self.current is None else self.current.to_json(),
            },
            "rto_seconds": self.rto_seconds,
            "storage": None if self.storage is None else self.storage.to_json(),
            "curve": self.curve,
            "assumptions": list(self.assumptions),
        }


class _Inputs:
    """Collects each input with where it came from."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}
        self.assumptions: list[str] = []

    def set(self, name: str, value: Any, source: str) -> Any:
        self.values[name] = {"value": value, "source": source}
        return value

    def assume(self, text: str) -> None:
        self.assumptions.append(text)


def _goodput(
    label: str,
    schedule: Schedule,
    policy: str,
    *,
    restart: float,
    mtbf: float,
    commit_delay: float,
    asynchronous: bool,
) -> Goodput:
    segments = schedule.segments()
    wall = iv.wall_time(segments, restart, mtbf)
    useful = schedule.total_steps * schedule.step_time
    saves = schedule.save_cost * len(schedule.points)
    # Wald: E[failures] E[min(X, R)] (no restart: none, even when the wall time overflows)
    restart_total = wall * -math.expm1(-restart / mtbf) if restart else 0.0
    mean = schedule.mean_interval()
    # Worst case: a failure just before a save commits loses its whole segment and, for an
    # asynchronous save, the training done while it was being written.
    window = commit_delay if asynchronous else schedule.save_cost
    rpo = max(w for w, _ in segments) + (window if any(c > 0 for _, c in segments) else 0.0)
    return Goodput(
        label=label,
        policy=policy,
        saves=len(schedule.points),
        interval_seconds=mean,
        interval_steps=None if mean is None else mean / schedule.step_time,
        wall_seconds=wall,
        useful_seconds=useful,
        save_seconds=saves,
        restart_seconds=restart_total,
        lost_seconds=wall - useful - saves - restart_total if math.isfinite(wall) else wall,
        failures=wall / mtbf,
        rpo_seconds=rpo,
        rpo_steps=rpo / schedule.step_time,
    )


def _simulated(inp: _Inputs, g: Goodput, schedule: Schedule, **kw: Any) -> dict[str, Any] | None:
    segments = schedule.segments()
    if len(segments) > SIMULATION_MAX_SAVES:
        inp.assume(
            f"no simulation of {g.policy}: {len(segments)} saves is more than the "
            f"simulation handles ({SIMULATION_MAX_SAVES}); the closed form stands alone"
        )
        return None
    try:
        return simulate(segments, useful=g.useful_seconds, **kw).to_json()
    except SimulationTooLong as exc:  # a run that (almost) never finishes: say so, not spin
        inp.assume(f"no simulation of {g.policy}: {exc}; the closed form stands alone")
        return None


def _mtbf(inp: _Inputs, mtbf: Duration | None, nodes: int | None, node_mtbf: Duration | None):
    if mtbf is not None:
        if nodes is not None or node_mtbf is not None:
            raise PlanError("give either --mtbf (the whole job's) or --nodes with --node-mtbf")
        return inp.set("mtbf_seconds", parse_duration("--mtbf", mtbf), "given")
    if node_mtbf is None or nodes is None:
        raise PlanError(
            "a plan needs the job's mean time between failures: --mtbf 24h, or --nodes 64 "
            "with --node-mtbf 5y (the job's MTBF is then node MTBF / nodes)"
        )
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise PlanError(f"--nodes must be a positive integer, got {nodes!r}")
    value = parse_duration("--node-mtbf", node_mtbf) / nodes
    inp.assume(f"independent node failures: job MTBF = node MTBF / {nodes}")
    return inp.set("mtbf_seconds", value, f"--node-mtbf / --nodes {nodes}")


def _as_policy(value: Any, option: str) -> Any:
    return parse_policy(value, option) if isinstance(value, str) else value


def plan(
    root: str | os.PathLike[str] | None = None,
    run: str | None = None,
    *,
    mtbf: Duration | None = None,
    nodes: int | None = None,
    node_mtbf: Duration | None = None,
    save_cost: Duration | None = None,
    write_time: Duration | None = None,
    restore_time: Duration | None = None,
    startup: Duration = 0.0,
    step_time: Duration | None = None,
    total_steps: int | None = None,
    duration: Duration | None = None,
    steps_per_epoch: int | None = None,
    save: Any = None,
    keep: Any = None,
    tiers: Any = None,
    size: int | str | None = None,
    new_size: int | str | None = None,
    prices: Mapping[str, float] | Iterable[str] | None = None,
    size_factors: Mapping[str, float] | None = None,
    simulate_trials: int = 1000,
    seed: int = 0,
    failures: str = "exponential",
    weibull_shape: float | None = None,
    start: float | None = None,
) -> Plan:
    """Plan checkpointing for ``run`` in the store at ``root`` (measured costs) or for a
    hypothetical job (everything given). See PLANNING.md for the model and its sources.

    Durations are seconds or strings like ``"24h"``; sizes bytes or ``"14GB"``; ``save``,
    ``keep`` and ``tiers`` policy objects or their text (``"KeepLast(3) | KeepEvery(steps=
    1000)"``); ``prices`` a mapping tier -> dollars per GB-month or strings
    ``"hot=0.10/GB-month"``. ``simulate_trials=0`` skips the Monte Carlo check.
    Raises :class:`~stepvault.planning.PlanError` naming the missing or bad input.
    """
    inp = _Inputs()
    measured = None
    if run is not None:
        from ..store import Store
        from .measure import measure_run

        measured = measure_run(Store.open(root if root is not None else "."), run)
        inp.assumptions.extend(measured.notes)
    m = _mtbf(inp, mtbf, nodes, node_mtbf)

    # -- what a save costs training, and when it is committed
    if save_cost is not None:
        delta = inp.set("save_cost_seconds", parse_duration("--save-cost", save_cost), "given")
    elif measured is not None and measured.save_cost is not None:
        delta = inp.set(
            "save_cost_seconds", measured.save_cost, f"measured: median of {measured.saves} saves"
        )
    elif measured is not None:
        raise PlanError(
            f"run {run!r} has no measured save (no 'save' event in its event log; saves by "
            "stepvault.save() outside a CheckpointManager are not logged): give --save-cost "
            "SECONDS, what training waits for per save"
        )
    else:
        raise PlanError(
            "give --save-cost SECONDS (what training waits for per save), or a RUN "
            "whose saves were measured"
        )
    delta = positive("--save-cost", delta)
    asynchronous = bool(measured and measured.asynchronous)
    if write_time is not None:
        commit = parse_duration("--write-time", write_time)
        asynchronous = commit > delta
        inp.set("commit_delay_seconds", max(commit, delta), "given (--write-time)")
    elif measured is not None and measured.commit_delay is not None:
        commit = inp.set("commit_delay_seconds", measured.commit_delay, "measured: stall + write")
    else:
        commit = inp.set("commit_delay_seconds", delta, "assumed: synchronous saves")
    inp.set("asynchronous", asynchronous, "measured" if measured else "given")

    # -- restart = start-up + restore
    if restore_time is not None:
        restore = inp.set(
            "restore_seconds", parse_duration("--restore-time", restore_time, zero_ok=True), "given"
        )
    elif measured is not None and measured.restore_seconds is not None:
        restore = inp.set(
            "restore_seconds",
            measured.restore_seconds,
            f"measured: median of {measured.restores} restores",
        )
    else:
        restore = inp.set("restore_seconds", commit, "assumed: as long as a save's write")
        inp.assume(
            f"restore time not measured: assumed {commit:.3g} s (the write time); "
            "give --restore-time"
        )
    boot = inp.set("startup_seconds", parse_duration("--startup", startup, zero_ok=True), "given")
    restart = inp.set("restart_seconds", restore + boot, "restore + start-up")
    if boot == 0:
        inp.assume("no start-up time (scheduling, process start, loading code): give --startup")

    # -- the run's length, in steps of a known time
    if step_time is not None:
        st = inp.set("step_time_seconds", parse_duration("--step-time", step_time), "given")
    elif measured is not None and measured.step_time is not None:
        st = inp.set(
            "step_time_seconds",
            measured.step_time,
            "measured: time between saves / steps between them",
        )
    elif duration is not None and total_steps is not None:
        st = inp.set(
            "step_time_seconds",
            parse_duration("--duration", duration) / total_steps,
            "--duration / --total-steps",
        )
    elif duration is not None and save is None:
        st = inp.set(
            "step_time_seconds", max(1.0, parse_duration("--duration", duration) / 1e5), "assumed"
        )
        inp.assume(f"no step time: a 'step' here is {st:.3g} s (give --step-time)")
    else:
        raise PlanError(
            "give --step-time SECONDS (step_time= in Python), or a RUN with two saves in one "
            "process to measure it; the interval alone needs only the save cost and the MTBF "
            "(stepvault plan --save-cost S --mtbf M, or planning.interval.daly_interval)"
        )
    if total_steps is None:
        if duration is None:
            raise PlanError(
                "give the planned length of the run: --total-steps N or --duration "
                "30d (total_steps= or duration= in Python; compute time, without saves and "
                "failures)"
            )
        total_steps = max(1, round(parse_duration("--duration", duration) / st))
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise PlanError(f"--total-steps must be a positive integer, got {total_steps!r}")
    inp.set("total_steps", total_steps, "given" if duration is None else "--duration / step")
    work = total_steps * st

    # -- the intervals
    young = iv.young_interval(delta, m)
    daly = iv.daly_interval(delta, m)
    exact = iv.exact_interval(delta, m)
    daly_steps = max(1, round(daly / st))
    interval = {
        "young_seconds": young,
        "daly_seconds": daly,
        "exact_seconds": exact,
        "young_steps": young / st,
        "daly_steps": daly / st,
        "optimum_policy": repr(every_steps(daly_steps)),
    }
    if delta >= 2 * m:
        inp.assume(
            "the save cost is at least twice the MTBF: Daly's interval is the MTBF; "
            "checkpointing cannot keep up with these failures"
        )
    if daly_steps > total_steps:
        inp.assume(
            f"the optimum interval ({daly_steps} steps) is longer than the run "
            f"({total_steps} steps): the optimum saves never; add LastStep() to --save "
            "to save at the end"
        )

    kw = dict(restart=restart, mtbf=m, commit_delay=commit, asynchronous=asynchronous)
    opt_schedule = save_schedule(
        every_steps(daly_steps),
        total_steps=total_steps,
        step_time=st,
        save_cost=delta,
        steps_per_epoch=steps_per_epoch,
    )
    optimum = _goodput("optimum (Daly)", opt_schedule, repr(every_steps(daly_steps)), **kw)

    current_policy = _as_policy(save, "--save")
    source = "given"
    if current_policy is None and measured is not None and measured.save_every_steps:
        current_policy = every_steps(measured.save_every_steps)
        source = "measured: median steps between saves"
    current = None
    cur_schedule = None
    if current_policy is not None:
        cur_schedule = save_schedule(
            current_policy,
            total_steps=total_steps,
            step_time=st,
            save_cost=delta,
            steps_per_epoch=steps_per_epoch,
        )
        current = _goodput("current", cur_schedule, repr(current_policy), **kw)
        inp.set("save_policy", repr(current_policy), source)
        if not cur_schedule.points:
            inp.assume(
                f"the save policy {current_policy!r} never saves within the run "
                f"({total_steps} steps): a failure restarts the run from the beginning"
            )
        interval["current_seconds"] = current.interval_seconds
        interval["current_steps"] = current.interval_steps

    for g, sched in ((optimum, opt_schedule), (current, cur_schedule)):
        if g is None or sched is None or not asynchronous:
            continue
        shortest = min((w for w, c in sched.segments() if c > 0), default=math.inf)
        if commit > shortest:
            inp.assume(
                f"{g.policy}: an asynchronous save takes {commit:.3g} s to commit, longer than "
                f"the interval ({shortest:.3g} s): each save waits for the one before, which "
                "the closed form does not count (the simulation does)"
            )

    if simulate_trials:
        sim_kw = dict(
            restart=restart,
            mtbf=m,
            trials=simulate_trials,
            seed=seed,
            distribution=failures,
            weibull_shape=weibull_shape,
            commit_delay=commit if asynchronous else None,
        )
        optimum.simulated = _simulated(inp, optimum, opt_schedule, **sim_kw)
        if current is not None and cur_schedule is not None:
            current.simulated = _simulated(inp, current, cur_schedule, **sim_kw)
        if failures != "exponential":
            inp.assume(
                "the closed forms assume exponential failures; the simulation used "
                f"{failures} (shape {weibull_shape}): their difference is the model's"
            )

    if cur_schedule is None and (size is not None or keep is not None or tiers is not None):
        inp.assume(f"no current save policy (--save): storage is forecast for {optimum.policy}")
    storage = _storage(
        inp,
        measured,
        cur_schedule or opt_schedule,
        keep=keep,
        tiers=tiers,
        size=size,
        new_size=new_size,
        prices=prices,
        size_factors=size_factors,
        start=time.time() if start is None else start,
    )
    curve = [
        {"interval_seconds": tau, "ettr": work / iv.daly_wall_time(work, tau, delta, restart, m)}
        for tau in (daly * 10 ** (i / 10 - 1.3) for i in range(27))
    ]
    return Plan(
        run=run,
        inputs=inp.values,
        interval=interval,
        optimum=optimum,
        current=current,
        rto_seconds=iv.restart_time_expected(restart, m),
        storage=storage,
        assumptions=inp.assumptions,
        curve=curve,
    )


def _prices(prices: Mapping[str, float] | Iterable[str] | None) -> dict[str, float]:
    out = dict(DEFAULT_PRICES)
    if prices is None:
        return out
    if isinstance(prices, Mapping):
        for tier, value in prices.items():
            out[tier] = positive(f"--price {tier}", value, zero_ok=True)
        return out
    for text in prices:
        tier, value = parse_price(text)
        out[tier] = value
    return out


def _storage(
    inp: _Inputs,
    measured: Any,
    schedule: Schedule,
    *,
    keep: Any,
    tiers: Any,
    size: Any,
    new_size: Any,
    prices: Any,
    size_factors: Mapping[str, float] | None,
    start: float,
) -> StorageForecast | None:
    if size is not None:
        stored = parse_size("--size", size)
        new = stored if new_size is None else parse_size("--new-size", new_size)
        if new > stored:
            raise PlanError(f"--new-size ({new}) cannot exceed --size ({stored})")
        sizes = {"full": (stored, new)}
        inp.set("sizes", {"full": {"stored_bytes": stored, "new_bytes": new}}, "given")
    elif measured is not None and measured.sizes:
        sizes = dict(measured.sizes)
        inp.set(
            "sizes",
            {k: {"stored_bytes": s, "new_bytes": n} for k, (s, n) in sizes.items()},
            "measured: median stored and new bytes per save",
        )
    else:
        if keep is not None or tiers is not None:
            raise PlanError(
                "a storage forecast needs the size of a checkpoint: --size 14GB "
                "(stored bytes per checkpoint; --new-size for what each adds)"
            )
        inp.assume("no checkpoint size: no storage forecast (give --size)")
        return None
    sizes.setdefault("full", next(iter(sizes.values())))
    for tier, factor in (size_factors or {}).items():
        positive(f"--size-factor {tier}", factor)
    keep_policy = _as_policy(keep, "--keep")
    tier_policy = _as_policy(tiers, "--tiers")
    inp.set("keep_policy", repr(keep_policy) if keep_policy else None, "given")
    inp.set("tier_policy", repr(tier_policy) if tier_policy else None, "given")
    if keep_policy is None:
        inp.assume("no keep policy: every checkpoint stays in hot (give --keep)")
    return forecast_storage(
        schedule,
        sizes=sizes,
        keep=keep_policy,
        tiers=tier_policy,
        prices=_prices(prices),
        size_factors=size_factors,
        start=start,
    )


def plan_json(root: str | os.PathLike[str], run: str, **options: Any) -> dict[str, Any]:
    """The plan of ``run`` as a JSON-able dict (what the dashboard shows); ``options`` as
    for :func:`plan`. A bad or missing input gives ``{"error": message}`` instead of
    raising, so a page can show what to set."""
    try:
        return plan(root, run, **options).to_json()
    except PlanError as exc:
        return {"schema": "stepvault-plan/1", "run": run, "error": str(exc)}
