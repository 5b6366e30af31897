"""Applying a tier policy: copy what cold tiers should hold, then evict what hot should not.

:func:`apply_tier_policy` is one pass for one run (used by the CLI and by the background
:class:`TierMover` that a :class:`~stepvault.CheckpointManager` with a tier policy runs
after each commit). Crash consistency comes from the order of operations:

1. copy: objects, then the manifest with create-if-absent (see :mod:`.copy`);
2. evict: only once every tier the plan wants the checkpoint in has its manifest
   committed (checked again right before), delete the hot manifest — atomically;
3. sweep the hot tier's unreferenced objects (GC with its grace period).

Killed at any instant, each tier still holds only complete checkpoints, and every
checkpoint is in at least one tier unless the policy meant to drop it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..catalog.events import log_event
from ..catalog.records import checkpoint_records
from ..engine.gc import DEFAULT_GRACE_SECONDS, sweep
from ..errors import StepvaultError
from ..policy import CheckpointRecord, TierPlan, TierPolicy, plan_tiers
from ..store import Store
from ..store.reader_holds import live_holds
from .config import HOT, Tiers
from .copy import DEFAULT_COPY_WORKERS, CopyStats, copy_checkpoint, copy_pin

#: The mover sweeps hot while saves are in flight in the same process: never with less grace.
CONCURRENT_GRACE_FLOOR = 60.0


def protected_steps(store: Store, run: str) -> set[int]:
    """Pinned steps (and registry holds, where the store has them)."""
    method = getattr(store, "protected_steps", None)
    if method is not None:
        return set(method(run))
    return set(store.pinned_steps(run))


@dataclass
class MoveReport:
    """What one pass did: the plan, the copies, evictions, failures and GC."""

    run: str
    plan: TierPlan
    dry_run: bool = False
    copies: list[CopyStats] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    seconds: float = 0.0
    #: bytes written into each cold tier by this pass
    bytes_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_copied(self) -> int:
        return sum(c.bytes_written for c in self.copies)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "dry_run": self.dry_run,
            "plan": self.plan.to_json(),
            "copies": [c.to_json() for c in self.copies],
            "evicted": self.evicted,
            "failed": self.failed,
            "freed_bytes": self.freed_bytes,
            "bytes_by_tier": self.bytes_by_tier,
            "seconds": self.seconds,
        }


def _holdings(tiers: Tiers, run: str, names: set[str]) -> dict[str, set[int]]:
    return {name: set(tiers[name].list_steps(run)) for name in sorted(names)}


def apply_tier_policy(
    tiers: Tiers,
    run: str,
    policy: TierPolicy,
    *,
    now: float | None = None,
    dry_run: bool = False,
    workers: int = DEFAULT_COPY_WORKERS,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    records: dict[int, CheckpointRecord] | None = None,
    log: bool = True,
    before_commit: Callable[[int, str], None] | None = None,
) -> MoveReport:
    """Plan and carry out the copies and evictions ``policy`` asks for on ``run``.

    A copy that fails (network down, damaged source object) is reported in ``failed``
    and logged; its checkpoint then stays in hot. The caller must be the run's writer (or
    hold its lease): eviction deletes hot manifests.
    """
    t0 = time.perf_counter()
    for name in policy.tiers():
        tiers.spec(name)  # unknown tier names fail here, with the list of known ones
    hot = tiers.hot
    now = time.time() if now is None else now
    holdings = _holdings(tiers, run, policy.tiers())
    plan = plan_tiers(checkpoint_records(hot, run, records), policy, now=now, holdings=holdings)
    report = MoveReport(run, plan, dry_run)
    if dry_run:
        return report

    def event(name: str, **fields: Any) -> None:
        if log:
            try:
                log_event(hot, run, name, **fields)
            except OSError:
                pass  # the event log must never stop the mover

    pinned = {e.step for e in plan.entries} & protected_steps(hot, run)
    for step, tier in plan.copies:
        hook = None if before_commit is None else (lambda s=step, t=tier: before_commit(s, t))
        try:
            stats = copy_checkpoint(
                hot,
                tiers[tier],
                run,
                step,
                codec=tiers.spec(tier).codec,
                workers=workers,
                before_commit=hook,
            )
            if step in pinned:
                copy_pin(hot, tiers[tier], run, step)
        except (StepvaultError, OSError) as exc:
            report.failed.append(f"{run}@{step} -> {tier}: {type(exc).__name__}: {exc}")
            event("tier_copy_failed", step=step, tier=tier, error=f"{type(exc).__name__}: {exc}")
            continue
        holdings[tier].add(step)
        report.copies.append(stats)
        report.bytes_by_tier[tier] = report.bytes_by_tier.get(tier, 0) + stats.bytes_written
        event(
            "tier_copy",
            step=step,
            tier=tier,
            objects=stats.copied_objects,
            reused=stats.reused_objects,
            bytes=stats.bytes_written,
            seconds=stats.seconds,
        )
    for step in plan.evictions:
        needed = plan.needs.get(step, set())
        key = Store.manifest_key(run, step)
        try:
            # Re-checked against the tiers themselves right before the delete.
            safe = all(step in holdings[t] and tiers[t].backend.exists(key) for t in needed)
        except (StepvaultError, OSError):
            safe = False
        if not safe or step in live_holds(hot, run, clean=False):
            continue  # not yet in every tier it needs, or a reader holds it: a later pass
        hot.delete_manifest(run, step)
        if records is not None:
            records.pop(step, None)
        report.evicted.append(step)
        event("tier_evict", step=step, kept_in=sorted(needed) or None)
    if report.evicted:
        swept = sweep(hot, grace_seconds=grace_seconds)
        report.freed_bytes = swept.freed_bytes
        event("gc", deleted_objects=len(swept.deleted), freed_bytes=swept.freed_bytes, by="tiers")
    report.seconds = time.perf_counter() - t0
    return report


def owed_steps(
    tiers: Tiers,
    run: str,
    policy: TierPolicy,
    steps: list[int],
    records: list[CheckpointRecord],
    holdings: dict[str, set[int]],
) -> set[int]:
    """Of ``steps``, those the policy wants in a cold tier that does not hold them yet
    (a keep policy must not delete them from hot before the mover copied them)."""
    placement = policy.place(sorted(records, key=lambda r: r.step), time.time(), holdings)
    owed: set[int] = set()
    for tier, wanted in placement.cold.items():
        held = holdings.get(tier, set())
        owed.update(s for s in steps if s in wanted and s not in held)
    return owed


class TierMover:
    """Runs :func:`apply_tier_policy` for one run on a background thread.

    :meth:`notify` (after each commit) only sets a flag: training never waits for the
    mover. Failures are kept in :attr:`last_error` and logged; the next pass retries.
    """

    def __init__(
        self,
        tiers: Tiers,
        run: str,
        policy: TierPolicy,
        *,
        workers: int = DEFAULT_COPY_WORKERS,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        recheck_seconds: float | None = None,
    ) -> None:
        for name in policy.tiers():
            tiers.spec(name)
        self._recheck = recheck_seconds
        self.tiers = tiers
        self.run = run
        self.policy = policy
        self.workers = workers
        self.grace_seconds = grace_seconds
        self.last_error: BaseException | None = None
        self.reports: list[MoveReport] = []
        self.bytes_moved: dict[str, int] = {HOT: 0, **{t: 0 for t in tiers.cold_names}}
        self._records: dict[int, CheckpointRecord] = {}
        self._holdings: dict[str, set[int]] | None = None
        self._cond = threading.Condition()
        self._requested = 0
        self._done = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        # Started on first use, so a manager that fails to open leaves no thread behind.
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="stepvault-tiers")
            self._thread.start()

    def notify(self) -> None:
        """Ask for a pass soon (returns at once)."""
        with self._cond:
            self._start()
            self._requested += 1
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Run a pass and wait until it is done; False on timeout."""
        with self._cond:
            self._start()
            self._requested += 1
            target = self._requested
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def hold(self, steps: list[int]) -> set[int]:
        """Steps of ``steps`` a keep policy must not delete yet (still owed to a cold tier)."""
        if not steps:
            return set()
        try:
            holdings = self._holdings
            if holdings is None:
                holdings = self._holdings = _holdings(self.tiers, self.run, self.policy.tiers())
            records = checkpoint_records(self.tiers.hot, self.run, self._records)
            return owed_steps(self.tiers, self.run, self.policy, steps, records, holdings)
        except (StepvaultError, OSError):
            return set(steps)  # cannot tell: keep them all for now

    @property
    def recheck_seconds(self) -> float | None:
        """How often the mover also runs without a new save: a rule that acts on age
        (``MoveAfter``) must move a checkpoint when it comes of age, even if training saves
        rarely or has stopped saving. By default a tenth of the shortest age, between 5 s
        and 10 min; None without age rules."""
        if self._recheck is not None:
            return self._recheck
        ages = self.policy.ages()
        if not ages:
            return None
        return min(600.0, max(5.0, min(ages) / 10))

    def _loop(self) -> None:
        while True:
            with self._cond:
                woken = self._cond.wait_for(
                    lambda: self._requested > self._done or self._stopping,
                    self.recheck_seconds,
                )
                if self._stopping and self._requested <= self._done:
                    return
                if not woken:  # the timer of an age rule: a pass of its own
                    self._requested += 1
                target = self._requested
            try:
                report = apply_tier_policy(
                    self.tiers,
                    self.run,
                    self.policy,
                    workers=self.workers,
                    # Saves run concurrently with this thread: their in-flight temp files
                    # and new objects must outlive this sweep whatever the grace setting.
                    grace_seconds=max(self.grace_seconds, CONCURRENT_GRACE_FLOOR),
                    records=self._records,
                )
                self._holdings = {
                    t: set(self.tiers[t].list_steps(self.run)) for t in self.policy.tiers()
                }
                for tier, nbytes in report.bytes_by_tier.items():
                    self.bytes_moved[tier] = self.bytes_moved.get(tier, 0) + nbytes
                self.reports = [*self.reports[-99:], report]
                self.last_error = None
            except BaseException as exc:  # kept for the caller; training goes on
                self.last_error = exc
                try:
                    log_event(self.tiers.hot, self.run, "tier_failed", error=f"{exc}")
                except (OSError, StepvaultError):
                    pass
            with self._cond:
                self._done = max(self._done, target)
                self._cond.notify_all()

    #: How long :meth:`close` waits for the last pass by default (an unreachable archive
    #: must not hang the end of training for ever; an interrupted move is crash-safe).
    close_timeout: float = 300.0

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop the mover; with ``wait`` finish a last pass first (up to ``timeout`` or
        :attr:`close_timeout` seconds; a move still running then is abandoned safely)."""
        if self._thread is None:
            if not wait:
                return
            # No save in this session (e.g. a run resumed right after its last save and
            # closed): a crashed predecessor may still owe copies, so make the last pass anyway.
            self._start()
        assert self._thread is not None  # _start() sets it
        timeout = self.close_timeout if timeout is None else timeout
        finished = True
        if wait and self._thread.is_alive():
            finished = self.drain(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout if finished else 0.1)
