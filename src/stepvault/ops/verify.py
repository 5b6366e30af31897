"""Verification: quick (manifests parse, objects present with the right size) and deep
(every object decoded and re-hashed). Each unique object is checked once per run of
``verify`` even when many checkpoints share it."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..engine import default_workers, fetch_object
from ..errors import CheckpointNotFoundError, IntegrityError, StepvaultError
from ..format import Manifest, parse_manifest
from ..store import Store, validate_run_name


@dataclass
class CheckpointReport:
    run: str
    step: int
    problems: list[str] = field(default_factory=list)
    #: the tiers holding its manifest, hot first (empty for a store without cold tiers)
    tiers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "ok": self.ok,
            "problems": self.problems,
            "tiers": self.tiers,
        }


@dataclass
class VerifyReport:
    deep: bool
    checkpoints: list[CheckpointReport] = field(default_factory=list)
    objects_checked: int = 0
    bytes_checked: int = 0
    bad_objects: dict[str, str] = field(default_factory=dict)
    #: tiers that could not be reached, with why: what only they hold was not checked
    unreachable: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checkpoints) and not self.unreachable

    @property
    def damaged(self) -> list[CheckpointReport]:
        return [c for c in self.checkpoints if not c.ok]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "deep": self.deep,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "objects_checked": self.objects_checked,
            "bytes_checked": self.bytes_checked,
            "bad_objects": self.bad_objects,
            "unreachable": self.unreachable,
        }


def _check_object_quick(store: Store, digest: str, expected_size: int) -> str | None:
    try:
        size = store.object_size(digest)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:  # e.g. ELOOP: a symlink planted in the store
        return f"cannot be read safely: {exc.strerror or exc}"
    if size != expected_size:
        return f"size {size} bytes, manifest says {expected_size} (truncated or replaced)"
    return None


def _check_object_deep(store: Store, digest: str, expected_size: int) -> str | None:
    problem = _check_object_quick(store, digest, expected_size)
    if problem:
        return problem
    try:
        fetch_object(store, digest, verify=True)
    except IntegrityError as exc:
        return str(exc)
    except StepvaultError as exc:  # e.g. a newer object version
        return str(exc)
    return None


def verify_store(
    store: Store,
    *,
    run: str | None = None,
    step: int | None = None,
    deep: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> VerifyReport:
    """Check every checkpoint of the store (or of ``run``, or just ``run@step``).

    ``progress(done, total)`` is called with the bytes checked so far (for a progress bar).
    A :class:`~stepvault.tiers.TieredView` (see :func:`verify`) checks every copy: each
    tier's checkpoints against that tier's own manifests and objects (a tier that
    re-encodes stores other sizes), each report naming the tiers that hold it and each
    problem the tier it is in; a tier that cannot be reached is listed in ``unreachable``
    (and the report is not ok: what only it holds was not checked).
    """
    from ..tiers.view import TieredView

    report = VerifyReport(deep=deep)
    targets: list[tuple[str, int]] = []
    runs = [run] if run is not None else store.list_runs()
    for r in runs:
        steps = [step] if step is not None else store.list_steps(r)
        targets += [(r, s) for s in steps]
    if not isinstance(store, TieredView):
        copies = [("", store, _collect(store, targets))]
    else:
        copies = []
        for name, tier in store._stores():
            held = {r: set(tier.list_steps(r)) for r in {r for r, _ in targets}}
            copies.append((name, tier, _collect(tier, [t for t in targets if t[1] in held[t[0]]])))
        # A tier with no store yet (nothing copied there) holds nothing: not unreachable.
        report.unreachable = {
            n: why for n, why in store.unreachable.items() if n not in store.absent
        }
    reports = {t: CheckpointReport(*t) for t in targets}
    found: dict[tuple[str, int], list[tuple[str, str]]] = {t: [] for t in targets}
    total = sum(sum(needed.values()) for _, _, (_, needed) in copies)
    for name, tier, (manifests, needed) in copies:
        bad = _check(tier, needed, deep, workers, report, progress, total)
        for target, m, problems in manifests:
            if name:
                reports[target].tiers.append(name)
            if m is not None:
                problems += [_object_problem(d, bad[d]) for d in m.objects if d in bad]
            found[target] += [(name, p) for p in problems]
        for digest, problem in bad.items():
            where = f"in {name}: " if name and len(copies) > 1 else ""
            report.bad_objects[digest] = ", ".join(
                filter(None, [report.bad_objects.get(digest), where + problem])
            )
    for target, rep in reports.items():
        # Name the tier of a problem when the checkpoint has copies in several.
        several = len(rep.tiers) > 1
        rep.problems = [f"in {n}: {p}" if several else p for n, p in found[target]]
        report.checkpoints.append(rep)
    return report


def _object_problem(digest: str, problem: str) -> str:
    name = f"object {digest[:16]}…"
    # A deep check's error names the object itself ("object 80cc… content does not...").
    return problem if problem.startswith(name) else f"{name}: {problem}"


def _collect(
    store: Store, targets: list[tuple[str, int]]
) -> tuple[list[tuple[tuple[str, int], Manifest | None, list[str]]], dict[str, int]]:
    """Each target's manifest in ``store`` (None and a problem when it cannot be read)
    and the objects they need, with the stored size each manifest records."""
    manifests: list[tuple[tuple[str, int], Manifest | None, list[str]]] = []
    needed: dict[str, int] = {}
    for r, s in targets:
        problems: list[str] = []
        try:
            m: Manifest | None = parse_manifest(store.read_manifest(r, s), f"{r}@{s}")
        except StepvaultError as exc:
            problems.append(f"manifest: {exc}")
            m = None
        if m is not None:
            for digest, obj in m.objects.items():
                needed.setdefault(digest, obj.size)
        manifests.append(((r, s), m, problems))
    return manifests, needed


def _check(
    store: Store,
    needed: dict[str, int],
    deep: bool,
    workers: int | None,
    report: VerifyReport,
    progress: Callable[[int, int | None], None] | None,
    total: int,
) -> dict[str, str]:
    """Check each object of ``needed`` once in ``store``; the problems by digest."""
    check = _check_object_deep if deep else _check_object_quick
    digests = list(needed)
    bad: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        results = pool.map(lambda d: check(store, d, needed[d]), digests)
        for digest, problem in zip(digests, results):
            report.objects_checked += 1
            report.bytes_checked += needed[digest]
            if problem:
                bad[digest] = problem
            if progress is not None:
                progress(report.bytes_checked, total)
    return bad


def verify(
    root: str | os.PathLike[str],
    run: str | None = None,
    step: int | None = None,
    *,
    deep: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> VerifyReport:
    """Check checkpoints: quick (objects present, sizes right) or ``deep`` (re-hash all).

    Every tier is checked, as :func:`stepvault.restore` reads them: a checkpoint only in a
    cold tier (``stepvault tier RUN --to archive --evict``) is verified there, and each
    :class:`CheckpointReport` names its ``tiers``. A ``run`` (or ``run@step``) that no tier
    holds raises :class:`~stepvault.errors.CheckpointNotFoundError` naming what exists.
    """
    from ..tiers.view import read_view

    store = read_view(Store.open(root))
    if run is not None:
        require_checkpoint(store, run, step)
    return verify_store(store, run=run, step=step, deep=deep, workers=workers, progress=progress)


def require_checkpoint(store: Store, run: str, step: int | None = None) -> None:
    """Raise :class:`~stepvault.errors.CheckpointNotFoundError` unless ``run`` (and
    ``run@step``) exists in ``store``; the message lists the runs (or steps) that do."""
    import difflib

    validate_run_name(run)
    runs = store.list_runs()
    if run not in runs:
        near = difflib.get_close_matches(run, runs, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        have = ", ".join(runs[:20]) + (", ..." if len(runs) > 20 else "") if runs else "none"
        raise CheckpointNotFoundError(f"no run {run!r} in {store.backend.url} (runs: {have}){hint}")
    if step is not None:
        steps = store.list_steps(run)
        if step not in steps:
            shown = ", ".join(map(str, steps[-10:]))
            more = f"{len(steps)} checkpoints, the newest: " if len(steps) > 10 else ""
            raise CheckpointNotFoundError(
                f"no checkpoint {run}@{step} in any tier of {store.backend.url} "
                f"({run} has {more}{shown or 'none'})"
            )
