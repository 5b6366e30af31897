"""Tier policies: where each checkpoint of a run should live, and why.

Rules are small objects that print as the expression that built them and compose with
``|`` (like keep policies)::

    policy = HotLast(3) | CopyEvery("archive", steps=5) | MoveAfter("archive", hours=6) \\
             | ArchiveProtected("archive")

* :class:`HotLast` — the hot tier keeps the ``k`` newest checkpoints; older ones leave it
  (once every cold tier that should hold them does);
* :class:`CopyEvery` — every ``n``-th step, or one checkpoint per ``T`` minutes, is copied to
  a cold tier;
* :class:`MoveAfter` — checkpoints older than an age are copied to a cold tier and then
  leave hot;
* :class:`ArchiveProtected` — pinned (and registry-held) checkpoints are copied to the archive,
  pins included, and stay there.

:func:`plan_tiers` turns a rule and the current state into a :class:`TierPlan` that names
every copy and eviction with its reasons, so a policy can be printed and dry-run. Whatever
the rules say, the plan never evicts from hot the newest valid full checkpoint (a restart
needs it fast) nor a pinned/held one, never evicts before every copy it needs is
committed, and never deletes anything from a cold tier: cold tiers are archives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .base import CheckpointRecord, flatten_union
from .validate import exactly_one, num, positive_int, seconds_in

__all__ = [
    "ArchiveProtected",
    "CopyEvery",
    "HotLast",
    "MemLast",
    "MoveAfter",
    "Placement",
    "TierAny",
    "TierPlan",
    "TierPolicy",
    "plan_tiers",
]


@dataclass
class Placement:
    """What one rule (or a union of rules) wants.

    ``hot``: steps the hot tier keeps (None: this rule says nothing about hot, i.e. keep
    all); ``cold``: tier -> step -> reason for the steps that tier should hold; ``move``:
    step -> reason for steps that should leave hot once their copies are committed.
    """

    hot: dict[int, str] | None = None
    cold: dict[str, dict[int, str]] = field(default_factory=dict)
    move: dict[int, str] = field(default_factory=dict)

    def merge(self, other: Placement) -> Placement:
        hot = None
        if self.hot is not None or other.hot is not None:
            hot = dict(self.hot or {})
            for step, reason in (other.hot or {}).items():
                hot[step] = f"{hot[step]}; {reason}" if step in hot else reason
        cold = {t: dict(s) for t, s in self.cold.items()}
        for tier, steps in other.cold.items():
            into = cold.setdefault(tier, {})
            for step, reason in steps.items():
                into[step] = f"{into[step]}; {reason}" if step in into else reason
        move = dict(self.move)
        for step, reason in other.move.items():
            move[step] = f"{move[step]}; {reason}" if step in move else reason
        return Placement(hot, cold, move)


class TierPolicy:
    """Decides where checkpoints live. Compose with ``a | b`` (union of what each wants)."""

    def place(
        self,
        records: list[CheckpointRecord],
        now: float,
        holdings: Mapping[str, set[int]],
    ) -> Placement:
        """``records``: the hot tier's checkpoints (sorted by step); ``holdings``: tier ->
        steps it holds now; ``now``: Unix time."""
        raise NotImplementedError

    def tiers(self) -> set[str]:
        """Cold tier names this rule refers to."""
        return set()

    def ages(self) -> list[float]:
        """Ages (seconds) at which this rule changes its mind about a checkpoint with no new
        save in between (``MoveAfter``): the mover then also wakes up on a timer."""
        return []

    def __or__(self, other: TierPolicy) -> TierPolicy:
        return TierAny(self, other)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


class TierAny(TierPolicy):
    """The union of its members: ``a | b | c`` builds one flat TierAny."""

    def __init__(self, *policies: TierPolicy) -> None:
        self.policies: tuple[TierPolicy, ...] = flatten_union(policies, TierPolicy, TierAny)

    def place(self, records, now, holdings) -> Placement:
        out = Placement()
        for p in self.policies:
            out = out.merge(p.place(records, now, holdings))
        return out

    def tiers(self) -> set[str]:
        return set().union(*(p.tiers() for p in self.policies))

    def ages(self) -> list[float]:
        return [a for p in self.policies for a in p.ages()]

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


def _duration(name: str, **units: float | timedelta | None) -> float:
    given = exactly_one(**units)
    if len(given) != 1:
        raise ValueError(f"{name} takes exactly one of {', '.join(f'{u}=' for u in units)}")
    ((unit, value),) = given.items()
    scale = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0, "age": 1.0}
    return seconds_in(name, unit, value, scale[unit])


class HotLast(TierPolicy):
    """The hot tier keeps the ``k`` newest valid checkpoints; older ones leave hot (after
    their cold copies, if any rule wants them somewhere, are committed; otherwise they are
    simply deleted, as a keep policy would)."""

    def __init__(self, k: int, tier: str = "hot") -> None:
        self.k = positive_int("HotLast(k)", k)
        if tier not in ("hot", "mem"):
            raise ValueError(f"HotLast(tier=) must be 'hot' or 'mem', got {tier!r}")
        # tier="mem": the mem tier keeps the k newest (applied by the mem tier's writer,
        # stepvault.manager.mem_saving); it says nothing about hot or cold tiers.
        self.tier = tier

    def place(self, records, now, holdings) -> Placement:
        if self.tier != "hot":
            return Placement()
        newest = [r for r in records if r.valid][-self.k :]
        return Placement(hot={r.step: f"last {self.k} in hot" for r in newest})

    def __repr__(self) -> str:
        return f"HotLast({self.k})" if self.tier == "hot" else f"MemLast({self.k})"


class MemLast(HotLast):
    """The mem tier keeps the ``k`` newest checkpoints (``HotLast(k, tier="mem")``)."""

    def __init__(self, k: int) -> None:
        super().__init__(k, tier="mem")


class CopyEvery(TierPolicy):
    """Copy every ``steps``-th checkpoint (``step % steps == 0``), or one checkpoint per
    ``minutes``/``seconds``/``hours`` (the first at least that long after the newest copy the
    tier already holds), to cold tier ``tier``. The hot copy stays (HotLast decides)."""

    def __init__(
        self,
        tier: str,
        *,
        steps: int | None = None,
        minutes: float | None = None,
        seconds: float | None = None,
        hours: float | None = None,
    ) -> None:
        self.tier = tier
        self.steps = None if steps is None else positive_int("CopyEvery(steps=)", steps)
        if self.steps is not None and any(v is not None for v in (minutes, seconds, hours)):
            raise ValueError("CopyEvery takes steps= or a time interval, not both")
        self.interval = None
        if self.steps is None:
            self.interval = _duration("CopyEvery", minutes=minutes, seconds=seconds, hours=hours)
            if self.interval <= 0:
                raise ValueError("CopyEvery: the interval must be positive")

    def place(self, records, now, holdings) -> Placement:
        if self.tier == "hot":  # with a mem tier: which saves also go to disk (mem_saving)
            return Placement()
        valid = [r for r in records if r.valid]
        if self.steps is not None:
            reason = f"every {self.steps} steps to {self.tier}"
            chosen = {r.step: reason for r in valid if r.step % self.steps == 0}
        else:
            assert self.interval is not None
            reason = f"one per {num(self.interval / 60)} min to {self.tier}"
            held = holdings.get(self.tier, set())
            last = max((r.created for r in valid if r.step in held), default=-math.inf)
            chosen = {}
            for r in sorted(valid, key=lambda r: (r.created, r.step)):
                if r.step in held:
                    last = max(last, r.created)
                    chosen[r.step] = reason
                elif r.created - last >= self.interval:
                    chosen[r.step] = reason
                    last = r.created
        return Placement(cold={self.tier: chosen})

    def tiers(self) -> set[str]:
        return set() if self.tier == "hot" else {self.tier}

    def __repr__(self) -> str:
        if self.steps is not None:
            return f"CopyEvery({self.tier!r}, steps={self.steps})"
        return f"CopyEvery({self.tier!r}, minutes={num((self.interval or 0) / 60)})"


class MoveAfter(TierPolicy):
    """Checkpoints created more than an age ago move to cold tier ``tier``: copied there,
    then removed from hot."""

    def __init__(
        self,
        tier: str,
        age: timedelta | float | None = None,
        *,
        minutes: float | None = None,
        hours: float | None = None,
        days: float | None = None,
    ) -> None:
        self.tier = tier
        self.age = _duration("MoveAfter", age=age, minutes=minutes, hours=hours, days=days)

    def place(self, records, now, holdings) -> Placement:
        reason = f"older than {num(self.age / 60)} min: moved to {self.tier}"
        old = {r.step: reason for r in records if r.valid and r.created <= now - self.age}
        return Placement(cold={self.tier: dict(old)}, move=dict(old))

    def ages(self) -> list[float]:
        return [self.age]

    def tiers(self) -> set[str]:
        return {self.tier}

    def __repr__(self) -> str:
        return f"MoveAfter({self.tier!r}, minutes={num(self.age / 60)})"


class ArchiveProtected(TierPolicy):
    """Pinned (or registry-held) checkpoints are copied to ``tier`` with their pin, so the
    archive keeps them for good (cold tiers are never pruned by the mover)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier

    def place(self, records, now, holdings) -> Placement:
        chosen = {r.step: f"pinned: archived in {self.tier}" for r in records if r.pinned}
        return Placement(cold={self.tier: chosen})

    def tiers(self) -> set[str]:
        return {self.tier}

    def __repr__(self) -> str:
        return f"ArchiveProtected({self.tier!r})"


@dataclass
class TierEntry:
    step: int
    #: tiers that hold it now (before the plan runs)
    held: list[str]
    #: cold tier -> reason, for copies the plan makes
    copy: dict[str, str] = field(default_factory=dict)
    #: "evict" (leaves hot, safe elsewhere), "drop" (no tier wants it: deleted), or ""
    hot_action: str = ""
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "held": self.held,
            "copy": self.copy,
            "hot_action": self.hot_action,
            "reasons": self.reasons,
        }


@dataclass
class TierPlan:
    """Copies and evictions for one run, with the reason for each."""

    entries: list[TierEntry]
    #: cold tier -> steps it must hold before the step may leave hot
    needs: dict[int, set[str]] = field(default_factory=dict)

    @property
    def copies(self) -> list[tuple[int, str]]:
        return [(e.step, t) for e in self.entries for t in e.copy]

    @property
    def evictions(self) -> list[int]:
        return [e.step for e in self.entries if e.hot_action in ("evict", "drop")]

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries]

    def __str__(self) -> str:
        lines = []
        for e in self.entries:
            acts = [f"copy->{t}" for t in e.copy] + ([e.hot_action] if e.hot_action else [])
            lines.append(
                f"{e.step:>10}  in {','.join(e.held) or '-':<16} {' '.join(acts) or 'stay':<24}"
                f"  {'; '.join(e.reasons)}"
            )
        return "\n".join(lines)


def plan_tiers(
    records: Iterable[CheckpointRecord],
    policy: TierPolicy,
    *,
    now: float,
    holdings: Mapping[str, set[int]],
) -> TierPlan:
    """Plan copies and hot evictions for a run's hot checkpoints ``records``.

    ``holdings`` maps each cold tier to the steps it holds now. Damaged records
    (``valid=False``) are left alone: never copied (damage must not spread), never
    evicted by the mover (retention and GC deal with them).
    """
    ordered = sorted(records, key=lambda r: r.step)
    placement = policy.place(list(ordered), now, holdings)
    newest_full = [r.step for r in ordered if r.valid and r.kind == "full"][-1:]
    entries = []
    needs: dict[int, set[str]] = {}
    for r in ordered:
        held = ["hot"] + [t for t, steps in holdings.items() if r.step in steps]
        entry = TierEntry(r.step, held)
        if not r.valid:
            entry.reasons.append("damaged: left alone")
            entries.append(entry)
            continue
        wanted = {t: steps[r.step] for t, steps in placement.cold.items() if r.step in steps}
        needs[r.step] = set(wanted)
        for tier, reason in wanted.items():
            if r.step not in holdings.get(tier, set()):
                entry.copy[tier] = reason
            entry.reasons.append(reason)
        leave = r.step in placement.move or (
            placement.hot is not None and r.step not in placement.hot
        )
        if placement.hot is not None and r.step in placement.hot:
            entry.reasons.append(placement.hot[r.step])
        if leave:
            if r.pinned:
                entry.reasons.append("pinned: stays in hot")
            elif r.step in newest_full:
                entry.reasons.append("newest valid checkpoint: stays in hot")
            else:
                entry.hot_action = "evict" if wanted else "drop"
                if not wanted:
                    entry.reasons.append("no tier wants it")
        entries.append(entry)
    return TierPlan(entries, needs)
