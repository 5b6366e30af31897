"""Policy interfaces: when to save, what to keep. Policies are data, not code paths: small
objects that print, compose with ``|``, and are tested and dry-run on their own.

Each interface lives here together with the union its ``|`` builds (:class:`AnyOf` for
save rules, :class:`KeepAny` for keep rules): ``a | b`` must construct the union, and
keeping both in one module is what lets :mod:`.save` and :mod:`.keep` import this module
without it importing them back (no import circle). They re-export the unions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .._units import human_bytes
from ..format.record import CheckpointRecord

P = TypeVar("P")


def flatten_union(
    policies: Sequence[object],
    member: type[P],
    union: type,
    *,
    by_identity: bool = False,
) -> tuple[P, ...]:
    """The members of a ``|`` union, flattened (a nested union gives its members), in the
    order given, each once (by identity or by equality); a clear error for a member of the
    wrong type or for an empty union."""
    flat: list[P] = []
    for policy in policies:
        if not isinstance(policy, member):
            raise TypeError(
                f"{union.__name__} members must be {member.__name__} objects, got {policy!r}"
            )
        nested = isinstance(policy, union)
        for item in cast(Any, policy).policies if nested else (policy,):
            seen = any(item is s for s in flat) if by_identity else item in flat
            if not seen:
                flat.append(item)
    if not flat:
        raise ValueError(f"{union.__name__}() needs at least one policy")
    return tuple(flat)


@dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at for one step boundary."""

    step: int
    epoch: int | None
    now: float  # time.monotonic() seconds
    last_save_step: int | None = None
    last_save_time: float | None = None  # monotonic time of the last committed or started save
    #: measured cost of one save as the training loop sees it (stall for async saves), seconds
    save_cost: float | None = None
    #: total steps of the run when known (for "last step" rules)
    total_steps: int | None = None


@dataclass(frozen=True)
class SaveDecision:
    """A policy's answer: save now, which kind, why, and how."""

    kind: str = "full"  # "full" (whole state) or "weights" (modules only)
    reason: str = ""
    #: save synchronously (e.g. on a preemption signal) instead of in the background
    urgent: bool = False
    #: after the save, exit the process with this code (None: continue training)
    exit_code: int | None = None


class SavePolicy:
    """Decides at each step boundary whether to save. Compose with ``a | b``."""

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        raise NotImplementedError

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        """Called after a save was started at ``ctx`` (lets stateful rules re-arm)."""

    def install(self) -> None:
        """Called once by the manager (main thread) before training (signal handlers)."""

    def uninstall(self) -> None:
        """Undo :meth:`install`."""

    def __or__(self, other: SavePolicy) -> SavePolicy:
        return AnyOf(self, other)


def merge_decisions(decisions: Sequence[SaveDecision]) -> SaveDecision | None:
    """Fold several rules' decisions for one step boundary into the strongest one.

    One save satisfies every rule that fired, so the merged save must be at least as
    strong as each of them: urgent if any is urgent, ``"full"`` if any wants the full
    state, every reason kept (``"; "``-joined, in the order given, duplicates dropped).
    The exit code comes from the first urgent decision that has one (an urgent save is
    the one that is about preemption); with no urgent decision, from the first that has
    one. Returns None for an empty sequence.
    """
    if not decisions:
        return None
    if len(decisions) == 1:
        return decisions[0]
    urgent = [d for d in decisions if d.urgent]
    kind = "full" if any(d.kind == "full" for d in decisions) else decisions[0].kind
    reasons = list(dict.fromkeys(d.reason for d in decisions if d.reason))
    exit_from = urgent or decisions
    exit_code = next((d.exit_code for d in exit_from if d.exit_code is not None), None)
    return SaveDecision(
        kind=kind, reason="; ".join(reasons), urgent=bool(urgent), exit_code=exit_code
    )


# --------------------------------------------------------------------------- composition


class AnyOf(SavePolicy):
    """Save when any member rule wants to; ``a | b | c`` builds one flat ``AnyOf``.

    Every member is asked at every step boundary (no short-circuit), because stateful
    rules (timers, first-step, signals) must see each step to keep their state right.
    The answers are merged by :func:`merge_decisions`. :meth:`saved`, :meth:`install`
    and :meth:`uninstall` are passed to every member.
    """

    def __init__(self, *policies: SavePolicy) -> None:
        # The same stateful object twice would be asked twice per step and e.g. a
        # FirstStep would answer differently the second time: members are told apart by
        # identity.
        self._policies: tuple[SavePolicy, ...] = flatten_union(
            policies, SavePolicy, AnyOf, by_identity=True
        )

    @property
    def policies(self) -> tuple[SavePolicy, ...]:
        """The member rules, flattened, in the order given."""
        return self._policies

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        # A list, not a generator fed to any(): every member must run.
        answers = [policy.decide(ctx) for policy in self._policies]
        return merge_decisions([a for a in answers if a is not None])

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        for policy in self._policies:
            policy.saved(ctx, decision)

    def install(self) -> None:
        done: list[SavePolicy] = []
        try:
            for policy in self._policies:
                policy.install()
                done.append(policy)
        except BaseException:
            # Leave no half-installed signal handlers behind.
            for policy in reversed(done):
                policy.uninstall()
            raise

    def uninstall(self) -> None:
        for policy in reversed(self._policies):
            policy.uninstall()

    def __repr__(self) -> str:
        if len(self._policies) == 1:
            return f"AnyOf({self._policies[0]!r})"
        return " | ".join(repr(p) for p in self._policies)


@dataclass
class RetentionEntry:
    step: int
    keep: bool
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "keep": self.keep, "reasons": list(self.reasons)}


@dataclass
class ThinEntry:
    """A kept checkpoint a thinning rule (``ThinAfter``) is due for: thinned to its
    weights (``thin``), or left whole with the reason why (``thin=False``)."""

    step: int
    thin: bool
    reason: str
    dropped: list[str] = field(default_factory=list)  # top-level state keys it drops
    dropped_bytes: int = 0  # stored bytes no longer named by its manifest

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "thin": self.thin,
            "reason": self.reason,
            "dropped": list(self.dropped),
            "dropped_bytes": self.dropped_bytes,
        }

    def __str__(self) -> str:
        if not self.thin:
            return f"keep whole @{self.step}: {self.reason}"
        return (
            f"thin @{self.step}: drop {', '.join(self.dropped)} "
            f"({human_bytes(self.dropped_bytes)}; {self.reason})"
        )


@dataclass
class RetentionPlan:
    """Which checkpoints survive and which rule keeps each survivor (and, with a
    ``ThinAfter`` rule, which survivors lose their training-only state)."""

    entries: list[RetentionEntry]
    thin: list[ThinEntry] = field(default_factory=list)

    @property
    def delete(self) -> list[int]:
        return [e.step for e in self.entries if not e.keep]

    @property
    def keep(self) -> list[int]:
        return [e.step for e in self.entries if e.keep]

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries]

    def __str__(self) -> str:
        lines = []
        for e in self.entries:
            verdict = "keep  " if e.keep else "delete"
            lines.append(f"{verdict} {e.step:>10}  {'; '.join(e.reasons)}")
        lines.extend(str(t) for t in self.thin)
        return "\n".join(lines)


class KeepPolicy:
    """Selects checkpoints to keep, with a reason each. Compose with ``a | b`` (union)."""

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        """Map step -> reason for every record this rule keeps (records sorted by step)."""
        raise NotImplementedError

    def __or__(self, other: KeepPolicy) -> KeepPolicy:
        return KeepAny(self, other)


def tracked_metrics(policy: KeepPolicy | None) -> tuple[tuple[str, str], ...]:
    """The ``(metric, mode)`` pairs a policy ranks by: those of every :class:`KeepBest`
    in it, found through :class:`KeepAny`. A custom rule takes part by defining a
    ``tracked_metrics()`` method that returns such pairs."""
    method = getattr(policy, "tracked_metrics", None)
    if method is None:
        return ()
    return tuple(dict.fromkeys((str(m), str(mode)) for m, mode in method()))


def check_metrics_recorded(
    policy: KeepPolicy | None, known: list[str] | set[str], run: str = ""
) -> None:
    """Refuse a policy that ranks by a metric no checkpoint of ``run`` records (``known``):
    such a rule keeps nothing, so a typo (``val_los``) would leave only the newest
    checkpoint and delete the best ones. Raises :class:`InvalidNameError` naming the metric,
    the nearest recorded one and all of them."""
    import difflib

    from ..errors import InvalidNameError

    names = sorted(known)
    for metric, _ in tracked_metrics(policy):
        if metric in known:
            continue
        near = difflib.get_close_matches(metric, names, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        where = f"run {run!r}" if run else "the run"
        raise InvalidNameError(
            f"unknown metric {metric[:64]!r}: no checkpoint of {where} records it, so a "
            f"best-by rule would keep nothing; {hint}recorded: {', '.join(names) or 'none'}"
        )


class _Rule(KeepPolicy):
    """Value semantics for the stateless rules: equal configuration, equal rule."""

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Rule)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))


class KeepAny(_Rule):
    """Keep what any member rule keeps; ``a | b | c`` builds one flat ``KeepAny``.

    A checkpoint kept by several members gets all their reasons, ``"; "``-joined in
    member order.
    """

    def __init__(self, *policies: KeepPolicy) -> None:
        # Keep rules are stateless values: an equal rule twice is one rule.
        self._policies: tuple[KeepPolicy, ...] = flatten_union(policies, KeepPolicy, KeepAny)

    @property
    def policies(self) -> tuple[KeepPolicy, ...]:
        """The member rules, flattened, in the order given."""
        return self._policies

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        reasons: dict[int, list[str]] = {}
        for policy in self._policies:
            for step, reason in policy.select(records, now).items():
                found = reasons.setdefault(step, [])
                if reason not in found:
                    found.append(reason)
        return {step: "; ".join(found) for step, found in sorted(reasons.items())}

    def tracked_metrics(self) -> tuple[tuple[str, str], ...]:
        pairs: list[tuple[str, str]] = []
        for policy in self._policies:
            pairs.extend(tracked_metrics(policy))
        return tuple(dict.fromkeys(pairs))

    def _key(self) -> tuple[object, ...]:
        return self._policies

    def __repr__(self) -> str:
        if len(self._policies) == 1:
            return f"KeepAny({self._policies[0]!r})"
        return " | ".join(repr(p) for p in self._policies)
