"""Restore every rank from memory: its own node's, else its buddy node's.

The restart after a node was replaced: the new node's memory is empty, but its ranks'
checkpoints are still in the memory of their buddies (``distributed/replication.py``).
All ranks agree (one all-gather of what each holds) on the newest step that *every* rank
can get from its own memory or its buddy's; ranks that lack it fetch it from the buddy
into their own memory store (every object hash-verified as it arrives, the manifest
committed last), every rank verifies its copy completely (a rank whose own copy is
damaged fetches it again from its buddy), and only when all ranks verified does any rank
change its training state. If no step works on every rank, the caller
falls back to disk and object storage (``None`` is returned, and a ``restore_fallback``
event says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from typing import Any

from ..catalog.events import log_event
from ..distributed.replication import Replicator, rank_run
from ..errors import CorruptObjectError, StepvaultError
from .info import RestoreInfo, SkippedCheckpoint
from .planner import RestorePlanner


def restore_from_memory(
    replicator: Replicator,
    state: MutableMapping[str, Any],
    *,
    run: str,
    workers: int | None = None,
    min_step: int | None = None,
    step: int | None = None,
    target: Callable[[], MutableMapping[str, Any]] | None = None,
) -> RestoreInfo | None:
    """Collective: load this rank's newest memory checkpoint of ``run`` that every rank can
    get (own memory first, else the buddy's); None when there is none (use disk/S3).

    ``RestoreInfo.tier`` is ``"mem"`` or ``"peer"``; the ``restore`` event in the own
    store's log records the tier, the step and the seconds it took. ``min_step``: steps
    older than it are not taken (a newer checkpoint is on disk: the caller restores that).
    ``step``: only that step (``restore(step=N)``); None when some rank cannot get it.
    ``target``: builds what to load into, called only once a step is chosen (every rank
    then calls it); the rank memory's view of sharded state is built so, because building
    it initialises a fresh optimizer's state, which a fresh start must not do.
    """
    t0 = time.perf_counter()
    me = replicator.rank
    name = rank_run(run, me)
    # One planner: the objects hashed while the ranks agree are the ones placed (no second read).
    planner = RestorePlanner(replicator.own, name, workers=workers)
    with replicator.paused():
        held = replicator.holdings(run)
        common = set(held[0]["own"]) | set(held[0]["peer"])
        for doc in held[1:]:
            common &= set(doc["own"]) | set(doc["peer"])
        if min_step is not None:
            common = {s for s in common if s >= min_step}
        if step is not None:
            common &= {step}
        skipped: list[SkippedCheckpoint] = []
        chosen: int | None = None
        tier = "mem"
        for step in sorted(common, reverse=True):
            needs = [step not in doc["own"] for doc in held]
            reason = _fetch_and_verify(replicator, planner, run, step, needs, verify=True)
            ok = replicator.all_ok(reason is None)
            refetched = False
            if not ok:
                # An own copy that failed verification (its damaged objects quarantined)
                # is fetched again from the buddy's memory, when the buddy holds the step,
                # before every rank gives the step up.
                again = replicator.gather(
                    reason is not None and not needs[me] and step in held[me]["peer"]
                )
                if any(again):
                    if again[me]:
                        planner.forget(step)  # what it read of the damaged copy
                    retry = _fetch_and_verify(
                        replicator, planner, run, step, again, verify=again[me]
                    )
                    if again[me]:
                        reason, refetched = retry, retry is None
                    ok = replicator.all_ok(reason is None)
            if ok:
                chosen, tier = step, ("peer" if needs[me] or refetched else "mem")
                break
            planner.forget(step)  # its verified bytes are not needed any more
            skipped.append(SkippedCheckpoint(step=step, reason=reason or "failed on another rank"))
    if chosen is None:
        log_event(
            replicator.events,
            name,
            "restore_fallback",
            reason="no step in memory on every rank"
            if step is None
            else f"step {step} is not in memory on every rank",
            skipped=[s.step for s in skipped],
        )
        return None
    info = planner.restore(state if target is None else target(), [chosen], fallback=False)
    info.tier = tier
    info.skipped = skipped + info.skipped
    info.seconds = time.perf_counter() - t0
    log_event(
        replicator.events, name, "restore", step=chosen, tier=tier, seconds=round(info.seconds, 6)
    )
    return info


def _fetch_and_verify(
    replicator: Replicator,
    planner: RestorePlanner,
    run: str,
    step: int,
    needs: list[bool],
    *,
    verify: bool,
) -> str | None:
    """Collective: the ranks in ``needs`` fetch ``step`` from their buddies; then this
    rank verifies its copy when ``verify``. The reason it failed, or None."""
    try:
        got = replicator.fetch(run, step, needs)
        if got is not None and not got.committed:
            return got.skipped or "the replica could not be fetched"
        if verify:
            _verify(planner, step)
    except StepvaultError as exc:
        return str(exc)
    return None


def _verify(planner: RestorePlanner, step: int) -> None:
    """Read and hash every object of ``step`` in the own store (raises on damage); the
    planner keeps them for the restore."""
    opened = planner.open(step)
    try:
        opened.verify_all()
    except CorruptObjectError as exc:
        if exc.digest:
            planner.store.quarantine_object(exc.digest)  # never deduplicated into a later save
        planner.forget(step)
        raise


__all__ = ["restore_from_memory"]
