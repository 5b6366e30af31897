"""Reader holds as users and retention see them: ``stepvault.ops.hold(root, "run@step")`` and
the reason a held checkpoint survives a retention plan.

The files and their rules are :mod:`stepvault.store.reader_holds`; this module resolves a
``RUN@STEP`` reference, offers the context manager, and turns the live holds of a run into
plan entries (:func:`keep_held`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..policy import RetentionPlan
from ..store import Store
from ..store.reader_holds import DEFAULT_TTL, HoldRecord, ReaderHold, acquire_hold, try_hold
from .refs import resolve_ref

__all__ = ["hold", "holding", "keep_held"]


def _default_owner() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "reader"


def hold(
    root: str | os.PathLike[str] | Store,
    ref: str,
    *,
    ttl: float = DEFAULT_TTL,
    owner: str | None = None,
) -> ReaderHold:
    """Hold checkpoint ``ref`` (``"run@step"``, or ``"run@latest"``: the newest full one)
    for ``ttl`` seconds.

    While held, keep policies, ``ThinAfter``, tier eviction and GC of any process leave it
    alone; use it as a context manager (released on exit) or call ``release()``::

        with stepvault.ops.hold("ckpts", "exp1@4000", ttl=2 * 3600, owner="eval"):
            evaluate(stepvault.open("ckpts", run="exp1", step=4000))

    The hold is tied to this process: once the process is gone, it no longer counts.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    run, step = resolve_ref(store, ref)
    return acquire_hold(store, run, step, ttl=ttl, owner=owner or _default_owner())


@contextmanager
def holding(store: Store, run: str, step: int, owner: str) -> Iterator[ReaderHold | None]:
    """Hold ``run@step`` while a library reader (load, export) reads it; no hold where the
    store cannot be written (read-only credentials): reading never depends on it."""
    held = try_hold(store, run, step, owner=owner)
    try:
        yield held
    finally:
        if held is not None:
            try:
                held.release()
            except OSError:
                pass  # it expires on its own; a failed release must not fail the read


def keep_held(
    plan: RetentionPlan, holds: dict[int, list[HoldRecord]], now: float | None = None
) -> list[int]:
    """Keep every held checkpoint of ``plan`` (in place), naming its holders as the reason;
    return the steps that were to be deleted and are kept for a hold."""
    now = time.time() if now is None else now
    saved = []
    for entry in plan.entries:
        records = holds.get(entry.step)
        if not records:
            continue
        reasons = [r.describe(now) for r in records]
        if not entry.keep:
            entry.keep = True
            entry.reasons = reasons
            saved.append(entry.step)
        else:
            entry.reasons.extend(r for r in reasons if r not in entry.reasons)
    return saved
