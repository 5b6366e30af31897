"""Retention that lowers fidelity with age: ``ThinAfter`` drops the training-only state
(optimizer, scheduler, RNG, data position...) of old checkpoints and keeps their weights.

``ThinAfter`` is a keep rule that keeps nothing by itself: it says what happens to the
checkpoints the *other* rules keep once they are older than ``steps`` steps (behind the
newest checkpoint of the run) or ``days`` days::

    keep = KeepLast(3) | KeepEvery(steps=1000) | ThinAfter(days=7)

keeps the last three whole and a checkpoint every 1000 steps, whole for a week and as
weights only after that. A thinned checkpoint stays restorable for evaluation and export;
its kind becomes ``"weights"``. The invariants of :func:`thin_candidates` make sure the
newest valid full checkpoint (the one a resume needs) and pinned or registry-held ones are
never thinned; the catalog adds the checks that need the store (reader holds, signatures).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .base import CheckpointRecord, KeepAny, KeepPolicy, RetentionPlan, _Rule
from .validate import exactly_one, num, positive_int, positive_real

__all__ = ["ThinAfter", "thin_candidates", "thin_rules"]

NEWEST_FULL_REASON = "newest valid full checkpoint (needed to resume): never thinned"
PINNED_THIN_REASON = "pinned or held by the registry: never thinned"


class ThinAfter(_Rule):
    """Thin kept checkpoints older than ``steps`` steps or ``days`` days to their weights.

    Give exactly one of ``steps`` (an age in steps behind the newest checkpoint of the run)
    or ``days``. ``keep="weights"`` (the only level today) keeps the ``torch.nn.Module``
    entries of the state, as a ``what="weights"`` save does, and drops everything else.
    It keeps nothing on its own: combine it with keep rules (``KeepLast(3) | ThinAfter(...)``).
    """

    def __init__(
        self, *, days: float | None = None, steps: int | None = None, keep: str = "weights"
    ) -> None:
        given = exactly_one(days=days, steps=steps)
        if len(given) != 1:
            raise ValueError(
                "ThinAfter() takes exactly one of days= or steps=, e.g. ThinAfter(days=7) "
                "or ThinAfter(steps=10_000)"
            )
        if keep != "weights":
            raise ValueError(
                f"ThinAfter(keep=) must be 'weights' (the modules of the state), got {keep!r}"
            )
        self._keep = keep
        self._steps = None if steps is None else positive_int("ThinAfter(steps=)", steps)
        self._days = None if days is None else positive_real("ThinAfter(days=)", days)

    @property
    def steps(self) -> int | None:
        return self._steps

    @property
    def days(self) -> float | None:
        return self._days

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        return {}  # thins what other rules keep; keeps nothing itself

    def due(self, record: CheckpointRecord, newest_step: int, now: float) -> bool:
        """Whether ``record`` is old enough to thin (``now``: Unix time)."""
        if self._steps is not None:
            return newest_step - record.step >= self._steps
        assert self._days is not None
        return now - record.created >= self._days * 86400.0

    def thin_rules(self) -> tuple[ThinAfter, ...]:
        return (self,)

    def _key(self) -> tuple[object, ...]:
        return (self._steps, self._days, self._keep)

    def __repr__(self) -> str:
        if self._days is not None:
            return f"ThinAfter(days={num(self._days)})"
        return f"ThinAfter(steps={self._steps})"


def thin_rules(policy: KeepPolicy | None) -> tuple[ThinAfter, ...]:
    """The :class:`ThinAfter` rules of a policy (found through ``|`` unions)."""
    if isinstance(policy, ThinAfter):
        return (policy,)
    if isinstance(policy, KeepAny):
        found: list[ThinAfter] = []
        for member in policy.policies:
            found.extend(thin_rules(member))
        return tuple(dict.fromkeys(found))
    return ()


def _only_thinning(policy: KeepPolicy) -> bool:
    members: Iterable[Any] = policy.policies if isinstance(policy, KeepAny) else (policy,)
    return all(isinstance(m, ThinAfter) for m in members)


def thin_candidates(
    records: Iterable[CheckpointRecord],
    policy: KeepPolicy | None,
    plan: RetentionPlan,
    *,
    now: float,
) -> dict[int, tuple[str, str]]:
    """Kept checkpoints a :class:`ThinAfter` rule of ``policy`` is due for: ``step ->
    (rule, why_not)``, ``why_not`` empty (thin it) or the reason it stays whole (newest
    full, pinned, the base of a kept light checkpoint). Only valid
    ``"full"`` checkpoints that ``plan`` keeps are considered (a deleted one goes anyway).
    """
    rules = thin_rules(policy)
    if not rules:
        return {}
    assert policy is not None
    if _only_thinning(policy):
        raise ValueError(
            f"{policy!r} keeps nothing on its own and would let every checkpoint but the "
            "newest be deleted: combine it with keep rules, e.g. "
            f"KeepLast(3) | KeepEvery(steps=1000) | {rules[0]!r}"
        )
    ordered = sorted(records, key=lambda r: r.step)
    if not ordered:
        return {}
    newest_step = ordered[-1].step
    kept = set(plan.keep)
    full = [r for r in ordered if r.valid and r.kind == "full"]
    newest_full = full[-1].step if full else None
    # A kept light checkpoint restores on top of its base, and by default takes the base's
    # optimizer moments: thinning that base would leave the light one unable to resume.
    light_bases: dict[int, int] = {}
    for r in ordered:
        if r.step in kept and r.kind == "light" and r.base_step is not None:
            light_bases.setdefault(r.base_step, r.step)
    out: dict[int, tuple[str, str]] = {}
    for record in full:
        if record.step not in kept:
            continue
        due = [rule for rule in rules if rule.due(record, newest_step, now)]
        if not due:
            continue
        why_not = ""
        if record.step == newest_full:
            why_not = NEWEST_FULL_REASON
        elif record.pinned:
            why_not = PINNED_THIN_REASON
        elif record.step in light_bases:
            why_not = f"base of light @{light_bases[record.step]}"
        out[record.step] = (repr(due[0]), why_not)
    return out
