"""The save schedule a save policy produces over a planned run, without a training loop.

The real policy object is driven with the :class:`~stepvault.policy.SaveContext` the
manager would give it at each step boundary (on a simulated clock: each step costs the
step time, each save its stall), and told about each save through ``saved()``, exactly as
:class:`~stepvault.CheckpointManager` does. Failures are not part of the schedule: the
schedule is where the saves fall in the run's *progress*; :mod:`.simulate` then plays
failures against it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..policy import AnyOf, AtSteps, Every, LastStep, SaveContext, SavePolicy
from .units import PlanError

__all__ = ["MAX_SAVES", "MAX_STEPS", "SavePoint", "Schedule", "every_steps", "save_schedule"]

#: Driving a time- or epoch-based policy costs ~1 us per step boundary; beyond this many
#: steps the plan asks for a coarser description (a "step" of several steps) instead of
#: running for minutes.
MAX_STEPS = 5_000_000
#: The storage forecast costs ~0.1 ms per save (the real policies, after every save).
MAX_SAVES = 200_000


@dataclass(frozen=True)
class SavePoint:
    step: int
    kind: str  # "full" or "weights"
    wall: float  # seconds since the start of the run (failure-free clock), save started


@dataclass(frozen=True)
class Schedule:
    """The saves of a failure-free run of ``total_steps`` steps of ``step_time`` seconds."""

    total_steps: int
    step_time: float
    save_cost: float
    points: tuple[SavePoint, ...]

    @property
    def steps(self) -> list[int]:
        return [p.step for p in self.points]

    def segments(self) -> list[tuple[float, float]]:
        """``(compute seconds, save cost)`` between consecutive saves (only full saves can
        be resumed from, so weights-only saves cost time but start no new segment); a run
        that does not end with a full save has a last segment with cost 0."""
        out: list[tuple[float, float]] = []
        last = 0
        pending_cost = 0.0
        for p in self.points:
            if p.kind != "full":
                pending_cost += self.save_cost  # paid, but protects nothing
                continue
            out.append(((p.step - last) * self.step_time + pending_cost, self.save_cost))
            pending_cost = 0.0
            last = p.step
        if last < self.total_steps or pending_cost:
            out.append(((self.total_steps - last) * self.step_time + pending_cost, 0.0))
        return out

    def mean_interval(self) -> float | None:
        """Mean compute seconds between full saves (None with fewer than one full save)."""
        full = [s for s in self.segments() if s[1] > 0]
        return sum(w for w, _ in full) / len(full) if full else None


def _candidate_steps(policy: SavePolicy, total_steps: int) -> list[int] | None:
    """The only step boundaries at which a purely step-based policy can fire (``Every(steps=)``,
    ``AtSteps``, ``LastStep`` and unions of them: their ``decide`` depends on the step alone,
    so asking them elsewhere changes nothing); None when any member looks at time or epochs
    (or is unknown), and every boundary must be driven."""
    members = policy.policies if isinstance(policy, AnyOf) else (policy,)
    steps: set[int] = set()
    for member in members:
        if type(member) is Every and member.unit == "steps":
            n = int(member.value)
            steps.update(range(n, total_steps + 1, n))
        elif type(member) is AtSteps:
            steps.update(s for s in member.steps if 0 < s <= total_steps)
        elif type(member) is LastStep:
            steps.add(total_steps)
        else:
            return None
    return sorted(steps)


def every_steps(steps: int) -> SavePolicy:
    """``Every(steps=n)``, the policy a plan uses for "save every n steps"."""
    return Every(steps=max(1, int(steps)))


def save_schedule(
    policy: SavePolicy,
    *,
    total_steps: int,
    step_time: float,
    save_cost: float,
    steps_per_epoch: int | None = None,
) -> Schedule:
    """Drive ``policy`` through ``total_steps`` step boundaries and list its saves.

    The clock starts at 0 and advances by ``step_time`` per step and ``save_cost`` per save
    (what training waits for); ``ctx.save_cost`` is ``save_cost`` from the first save on (as
    the manager measures it), so ``YoungDaly`` fires at its steady interval. The manager's
    ``save(step, ...)`` is called after ``step`` steps are done, so the first boundary is 1.
    """
    members = policy.policies if isinstance(policy, AnyOf) else (policy,)
    if not steps_per_epoch and any(isinstance(m, Every) and m.unit == "epochs" for m in members):
        raise PlanError(f"{policy!r} saves by epochs: give --steps-per-epoch N")
    policy = copy.deepcopy(policy)  # timers and flags change as it runs; the caller's stay
    points: list[SavePoint] = []
    now = 0.0
    last_step: int | None = None
    last_time: float | None = None
    measured: float | None = None
    candidates = _candidate_steps(policy, total_steps)
    if candidates is None and total_steps > MAX_STEPS:
        raise PlanError(
            f"--total-steps {total_steps} is more step boundaries than a plan drives "
            f"({MAX_STEPS}); describe the run in coarser steps (e.g. --total-steps "
            f"{total_steps // 100} with a --step-time 100x longer and the policy's steps / 100)"
        )
    boundaries = range(1, total_steps + 1) if candidates is None else candidates
    previous = 0
    for step in boundaries:
        now += step_time * (step - previous)
        previous = step
        epoch = None if not steps_per_epoch else step // steps_per_epoch
        ctx = SaveContext(
            step=step,
            epoch=epoch,
            now=now,
            last_save_step=last_step,
            last_save_time=last_time,
            save_cost=measured,
            total_steps=total_steps,
        )
        decision = policy.decide(ctx)
        if decision is None:
            continue
        points.append(SavePoint(step, decision.kind, now))
        if len(points) > MAX_SAVES:
            raise PlanError(
                f"{policy!r} saves more than {MAX_SAVES} times in {total_steps} steps; plan a "
                "policy that saves less often (--save), or a shorter run (--total-steps)"
            )
        last_step, last_time = step, now
        policy.saved(ctx, decision)
        now += save_cost
        measured = save_cost
    return Schedule(total_steps, step_time, save_cost, tuple(points))
