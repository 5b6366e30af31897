"""Checkpoint records of a run, and the one choice of restore candidates.

:func:`checkpoint_records` is the listing that ``stepvault ls``, ``Vault.checkpoints``,
the manager's retention, ``stepvault gc``, the tier mover and the integrations share: one
:class:`~stepvault.format.record.CheckpointRecord` per committed manifest, with metrics
attached later (annotations) merged in and pins/holds marked. :func:`choose_candidates`
turns records into the steps a restore tries, in order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import IntegrityError, StepvaultError
from ..format import parse_manifest
from ..format.record import CheckpointRecord
from ..store import Store
from .annotations import manifest_id, merged_metrics, read_annotations
from .summaries import SummaryCache, summary_of, verified_body_digest

StepChoice = int | Literal["latest", "best"]


def damaged_record(run: str, step: int, error: str) -> CheckpointRecord:
    """The record of a manifest that cannot be read."""
    return CheckpointRecord(step, 0.0, kind="?", valid=False, run=run, error=error)


def listed_records(run: str, steps: Sequence[int]) -> list[CheckpointRecord]:
    """Records known from a listing alone (no manifest read; kind and metrics unknown):
    for a restore of "latest" that checks each candidate's kind when it opens it."""
    return [CheckpointRecord(step, 0.0, kind="?", run=run) for step in steps]


def record_of(
    run: str, step: int, data: bytes | Exception, cache: SummaryCache
) -> CheckpointRecord:
    """The record of one manifest file (``data``: its bytes, or the error reading it)."""
    try:
        if isinstance(data, Exception):
            raise data
        digest = verified_body_digest(data)
        summary = cache.get(digest, step) if digest else None
        if summary is None:
            summary = summary_of(parse_manifest(data, f"{run}@{step}"))
            if digest:
                cache.put(digest, summary)
    except (IntegrityError, StepvaultError) as exc:
        return damaged_record(run, step, str(exc))
    return CheckpointRecord(run=run, manifest_id=manifest_id(data), **summary)


def checkpoint_records(
    store: Store,
    run: str,
    cache: MutableMapping[int, CheckpointRecord] | None = None,
    *,
    steps: Sequence[int] | None = None,
    protected: bool = True,
) -> list[CheckpointRecord]:
    """Records of every committed checkpoint of ``run``, oldest first.

    Every manifest not in ``cache`` is read and its checksum verified (one that was
    summarised before is not parsed again: the run's summary cache); a damaged one gives
    ``valid=False`` with the reason. ``cache`` (step -> record, as read from manifests,
    which are immutable) spares re-reading; annotations and pins are applied on every call,
    so metrics attached by an evaluation job while training runs count at once.
    ``protected=False`` skips listing pins and holds (a restore does not need them).
    """
    cache = {} if cache is None else cache
    whole = steps is None
    steps = list(store.list_steps(run)) if steps is None else list(steps)
    # Our own step -> record view: another thread may drop entries from a shared ``cache``
    # while we read (the tier mover pops the steps it evicts while the writer thread asks
    # which steps retention must hold), and a listing must not fail on that.
    found = {s: rec for s in steps if (rec := cache.get(s)) is not None}
    missing = [s for s in steps if s not in found]
    if missing:
        summaries = SummaryCache(store, run)
        for step, data in store.read_manifests(run, missing):
            cache[step] = found[step] = record_of(run, step, data, summaries)
        if whole and len(missing) == len(steps):
            # Compacting keeps only the entries used: only after a listing of every step
            # (a page, or a listing that skipped cached steps, would drop the others).
            summaries.save()
    pinned = store.protected_steps(run) if protected else set()
    annotations = read_annotations(store, run)
    out = []
    for step in steps:
        rec = found[step]
        if step in annotations and rec.valid:
            rec = dataclasses.replace(
                rec, metrics=merged_metrics(rec.metrics, annotations[step], rec.manifest_id)
            )
        if (step in pinned) != rec.pinned:
            rec = dataclasses.replace(rec, pinned=step in pinned)
        out.append(rec)
    return out


@dataclass(frozen=True)
class Candidates:
    """The steps a restore tries, in order, and whether it may fall back past damage."""

    steps: list[int]
    fallback: bool


def best_first(
    records: Sequence[CheckpointRecord], metric: str, mode: str
) -> list[CheckpointRecord]:
    """Valid records scored by ``metric``, best first (the newer one first on a tie)."""
    scored = [r for r in records if r.valid and math.isfinite(r.metrics.get(metric, math.nan))]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(scored, key=lambda r: (sign * r.metrics[metric], -r.step))


def choose_candidates(
    records: Sequence[CheckpointRecord],
    step: StepChoice = "latest",
    *,
    best: tuple[str, str] | None = None,
    full_only: bool = True,
    light: bool = False,
) -> Candidates:
    """What a restore of ``step`` tries, from the run's records (oldest first).

    ``"latest"``: newest first; with ``full_only`` only full checkpoints (unreadable ones
    included, so that the restore reports them as skipped), and light ones too with
    ``light`` (the restore takes one only if no full one is newer). ``"best"``: scored by
    ``best=(metric, mode)``, best first. An int: exactly that step, no fallback.
    """
    if step == "latest":
        steps = [
            r.step
            for r in reversed(records)
            if not full_only or r.kind == "full" or not r.valid or (light and r.kind == "light")
        ]
        return Candidates(steps, True)
    if step == "best":
        if best is None:
            raise ValueError(
                "restoring the 'best' checkpoint needs a metric: pass best_metric= (or use a "
                "KeepBest keep policy)"
            )
        return Candidates([r.step for r in best_first(records, *best)], True)
    return Candidates([int(step)], False)
