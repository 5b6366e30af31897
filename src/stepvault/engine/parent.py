"""The parent of a new checkpoint: the writer's own last commit, not a listing of the run.

A manifest names its parent (the run's newest earlier checkpoint) and a save reuses the
parent's object table (chunks it already names cost one touch, no header lookups).
Finding the parent by listing ``runs/<run>/checkpoints`` made every save cost O(run
length): 220 saves/s into a fresh run, 70 into a run of 10,000 (2.8 s of 5.0 s in
``list_steps``), and on object storage one LIST request per 1,000 checkpoints per save.

One writer per run (the manager's lease; ``stepvault.save`` callers by convention) means
the newest earlier checkpoint of a run is the one this process committed last. So each
process remembers its last commit per (store, run); a save checks with one ``exists`` that
it is still there (retention or ``stepvault gc`` may have deleted it) and lists the run only
when it knows nothing better: the first save of a process into a run, a step at or below
the remembered one (a rewind), or a remembered parent that is gone.

The parent is a hint for dedup and the manifest's ``parent_step`` field, never a source of
truth: the writer still re-checks every reused object before the commit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import StepvaultError
from ..format import Manifest, ObjectEntry, parse_manifest
from ..store import Store

#: (store url, run) pairs remembered per process; a long-lived process writing many
#: runs forgets the least recently saved ones (their next save lists once).
MAX_REMEMBERED = 256

_lock = threading.Lock()
_last: OrderedDict[tuple[str, str], Manifest] = OrderedDict()


def _key(store: Store, run: str) -> tuple[str, str]:
    return (store.backend.url, run)


def remember_commit(store: Store, manifest: Manifest) -> None:
    """Record ``manifest`` as this process's newest commit of its run (after its commit)."""
    key = _key(store, manifest.run)
    with _lock:
        known = _last.get(key)
        if known is not None and known.step > manifest.step:
            return  # a rewrite of an older step does not make it the newest
        _last[key] = manifest
        _last.move_to_end(key)
        while len(_last) > MAX_REMEMBERED:
            _last.popitem(last=False)


def forget_commits(store: Store, run: str) -> None:
    """Drop what this process remembers of ``run`` (its checkpoints were rewritten)."""
    with _lock:
        _last.pop(_key(store, run), None)


def find_parent(
    store: Store, run: str, step: int, held: Manifest | None = None
) -> tuple[int | None, dict[str, ObjectEntry]]:
    """The parent step of a new checkpoint ``run@step`` and the parent's object table.

    ``held`` is a manifest the caller already holds (the manager's last commit); else the
    one this process remembers. Either is taken when it is older than ``step`` and still
    committed (one ``exists``); otherwise the run is listed once and the newest earlier
    step read (a parent that cannot be read gives an empty table: the save then asks the
    store per chunk, as without a parent).
    """
    candidates = [held] if held is not None else []
    with _lock:
        remembered = _last.get(_key(store, run))
    if remembered is not None:
        candidates.append(remembered)
    for m in sorted(candidates, key=lambda c: c.step, reverse=True):
        if m.run == run and m.step < step and store.backend.exists(store.manifest_key(run, m.step)):
            return m.step, m.objects
    earlier = [s for s in store.list_steps(run) if s < step]
    if not earlier:
        return None, {}
    parent = earlier[-1]
    try:
        m = parse_manifest(store.read_manifest(run, parent), f"{run}@{parent}")
    except StepvaultError:
        return parent, {}  # damaged or gone: no table to reuse
    return parent, m.objects
