"""Mark-and-sweep garbage collection of objects no checkpoint references.

Deletion runs opposite to commit: manifests go first (the checkpoint disappears
atomically), objects later. The sweep never removes an object that

* any committed manifest of any run references (mark phase reads them all), or
* was written or reused recently (its mtime is within ``grace_seconds``): a save in
  flight in another process writes new objects before its manifest exists, and touches
  the old objects it deduplicates against, so both are protected by the grace period.

The mtime is checked again right before each delete, and a writer re-checks that every
reused object still exists right before committing (re-writing it if not), which closes
the remaining window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ..errors import StepvaultError
from ..format import parse_manifest
from ..store import Store
from .object_lists import envelope_digest, load_object_lists, save_object_lists

DEFAULT_GRACE_SECONDS = 900.0


@dataclass
class SweepReport:
    dry_run: bool
    referenced: int = 0
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_in_grace: int = 0
    #: bytes of the unreferenced objects kept because they are younger than the grace period
    kept_in_grace_bytes: int = 0
    tmp_files_removed: int = 0
    unreadable_manifests: list[str] = field(default_factory=list)


#: ``{(run, step): objects}``: what a manifest would name after a change not yet made (a
#: dry run: an empty collection for a checkpoint it would delete, the kept objects of one it
#: would thin).
AsIf = Mapping[tuple[str, int], Collection[str]]


def referenced_objects(store: Store, as_if: AsIf | None = None) -> tuple[set[str], list[str]]:
    """Every object a committed manifest names, and the manifests that could not be read.

    Every manifest of every run is read; its object list comes from the lists recorded
    at commit (:mod:`.object_lists`) when its envelope names a recorded checksum, and from
    a full parse otherwise. Runs whose record was incomplete get it compacted. A manifest
    named in ``as_if`` counts with the objects given there instead of its own.
    """
    as_if = as_if or {}
    live: set[str] = set()
    unreadable: list[str] = []
    for run in store.list_runs():
        lists, had_log = load_object_lists(store, run)
        used: dict[str, list[str]] = {}
        parsed = 0
        for step, data in store.read_manifests(run, store.list_steps(run)):
            where = f"{run}@{step}"
            if isinstance(data, StepvaultError):
                unreadable.append(where)
                continue
            digest = envelope_digest(data)
            if digest is not None and digest in lists:
                used[digest] = lists[digest]
                live.update(as_if.get((run, step), lists[digest]))
                continue
            try:
                m = parse_manifest(data, where)
            except StepvaultError:
                unreadable.append(where)
                continue
            parsed += 1
            live.update(as_if.get((run, step), m.objects))
            if digest is not None:
                used[digest] = sorted(m.objects)
        if parsed or had_log or len(used) != len(lists):
            save_object_lists(store, run, used, had_log)
    return live, unreadable


def sweep(
    store: Store,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
    as_if: AsIf | None = None,
) -> SweepReport:
    """Delete unreferenced objects older than the grace period (and stale temp files).

    ``progress(done, total)`` is called with the number of objects examined so far.
    ``as_if`` (with ``dry_run``): count as if those manifests named only the objects given
    (:data:`AsIf`), so a preview of deletions counts what they would free.
    """
    if as_if and not dry_run:
        raise ValueError("sweep(as_if=...) only counts: pass dry_run=True")
    report = SweepReport(dry_run=dry_run)
    candidates = list(store.iter_objects())  # listed *before* marking: newer ones are skipped
    live, unreadable = referenced_objects(store, as_if)
    report.referenced = len(live)
    report.unreadable_manifests = unreadable
    if unreadable:
        # A manifest we cannot read may still reference objects: never sweep blindly.
        return report
    cutoff = time.time() - grace_seconds
    for i, digest in enumerate(candidates, 1):
        if progress is not None:
            progress(i, len(candidates))
        if digest in live:
            continue
        try:
            young = store.object_mtime(digest) > cutoff
            size = store.object_size(digest)
        except FileNotFoundError:
            continue
        if young:
            report.kept_in_grace += 1
            report.kept_in_grace_bytes += size
            continue
        if not dry_run:
            store.delete_object(digest)
        report.deleted.append(digest)
        report.freed_bytes += size
    for name in store.backend.list("tmp"):
        key = f"tmp/{name}"
        try:
            old = store.backend.mtime(key) <= cutoff
        except (FileNotFoundError, NotImplementedError):
            continue
        if old:
            report.tmp_files_removed += 1
            if not dry_run:
                store.backend.delete(key)
    return report
