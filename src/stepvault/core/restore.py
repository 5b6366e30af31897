"""The restore path of the core: candidates → open → check → verify → place.

:class:`RestorePlanner` opens each candidate once (one manifest parse), checks it against
the live state before a byte of tensor data is read, verifies every object it names, and
only then touches the live state. A damaged candidate is reported and the next one tried
(when falling back is allowed); a mismatch with the live state is the caller's mistake and
never falls back. ``restore`` (behind :func:`stepvault.restore`) chooses the candidates
from the catalog (:func:`stepvault.catalog.choose_candidates`) and dispatches checkpoints
written by several ranks to the distributed reader.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Literal

import torch

from .._progress import ProgressFn, terminal_bar
from ..catalog.records import choose_candidates, listed_records
from ..catalog.thinning import explain_weights_only
from ..engine import PendingArray
from ..errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    IntegrityError,
    NoValidCheckpointError,
    StateMismatchError,
    StepvaultError,
    StoreNotFoundError,
    StoreVersionError,
)
from ..format import decode_value
from ..state import apply, validate
from ..state.assigning import mapped_tree
from ..state.placement import place_and_materialize
from ..store import Store, validate_run_name, validate_step
from .info import RestoreInfo, SkippedCheckpoint
from .light import place_light, prepare_light
from .opened import OpenedCheckpoint, open_checkpoint
from .scope import is_collective

Root = str | os.PathLike[str]


class RestorePlanner:
    """Restores one run of ``store``: every candidate is opened at most once."""

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        workers: int | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.workers = workers
        #: ``progress(done, total)`` while a candidate's objects are fetched and verified
        self.progress = progress
        self._opened: dict[int, OpenedCheckpoint] = {}

    def open(self, step: int) -> OpenedCheckpoint:
        """``run@step`` opened (and kept: choosing and restoring it parse it once)."""
        opened = self._opened.get(step)
        if opened is None:
            opened = self._opened[step] = open_checkpoint(
                self.store, self.run, step, workers=self.workers
            )
        return opened

    def forget(self, step: int) -> None:
        """Drop ``run@step`` (and the verified bytes its reader holds)."""
        opened = self._opened.pop(step, None)
        if opened is not None:
            opened.release()

    def is_sharded(self, step: int) -> bool:
        """Whether ``step`` was written by several ranks; False when it cannot be opened
        (damaged or absent: restoring it reports that, and falls back)."""
        try:
            return self.open(step).sharded
        except StepvaultError:
            return False

    def restore(
        self,
        state: MutableMapping[str, Any],
        candidates: list[int],
        *,
        fallback: bool,
        strict: bool = True,
        full_only: bool = False,
        assign: bool = False,
        light: bool = False,
    ) -> RestoreInfo:
        """Restore the first of ``candidates`` that verifies (all tried if ``fallback``).

        ``full_only`` passes over weights-only checkpoints (they cannot restore a training
        state with an optimizer, step or RNG; they are not damaged, so not reported).
        ``assign``: see :func:`restore`. ``light``: a light checkpoint may be restored (base +
        decoded deltas, ``RestoreInfo.lossy``), but never one older than a full candidate
        already tried; without it light ones are passed over (not reported).
        """
        t0 = time.perf_counter()
        skipped: list[SkippedCheckpoint] = []
        weights_only_steps: list[int] = []
        seen_full = False
        for candidate in candidates:
            prepared = None
            try:
                opened = self._opened.pop(candidate, None) or open_checkpoint(
                    self.store, self.run, candidate, workers=self.workers
                )
                if opened.manifest.kind == "light":
                    if not light or seen_full:
                        opened.release()
                        continue
                    # its base is opened and verified too: a damaged base is reported here
                    prepared = prepare_light(
                        self.store,
                        opened,
                        state,
                        strict=strict,
                        workers=self.workers,
                        progress=self.progress,
                    )
                else:
                    seen_full = seen_full or opened.manifest.kind == "full"
                    if full_only and opened.manifest.kind != "full":
                        opened.release()
                        weights_only_steps.append(candidate)
                        continue
                    # A checkpoint that does not fit the live state is the caller's mistake,
                    # not damage: report it before reading a byte, and never fall back past it.
                    problems = validate(
                        state, opened.meta_tree, opened.manifest.state_kinds, strict=strict
                    )
                    if problems:
                        raise StateMismatchError(
                            explain_weights_only(opened.manifest, list(state), problems)
                        )
                    opened.verify_all(self.progress)
            except (IntegrityError, StoreVersionError) as exc:
                reason = str(exc)
                if isinstance(exc, CorruptObjectError) and exc.digest:
                    # A damaged object must not be "deduplicated" into future checkpoints.
                    reason += f" (object moved to {self.store.quarantine_object(exc.digest)})"
                if not fallback:
                    raise
                skipped.append(SkippedCheckpoint(candidate, reason))
                continue
            # Every object is verified and the state fits: only now is live state touched.
            if prepared is not None:
                place_light(prepared, state, strict=strict, assign=assign)
            else:
                place(opened, state, strict=strict, assign=assign)
            return RestoreInfo.of_manifest(
                opened.manifest, opened.metadata(), skipped, time.perf_counter() - t0
            )
        if weights_only_steps and not skipped:
            raise NoValidCheckpointError(
                f"run {self.run!r} has only weights-only checkpoints "
                f"({weights_only_steps[:5]}...), which cannot restore a training state; "
                "restore the modules alone ({'model': model}) or save full checkpoints"
            )
        reasons = "\n  ".join(f"{s.step}: {s.reason}" for s in skipped)
        raise NoValidCheckpointError(
            f"no checkpoint of run {self.run!r} verifies; tried {len(skipped)}:\n  {reasons}",
            skipped,
        )


def place(
    opened: OpenedCheckpoint,
    state: MutableMapping[str, Any],
    *,
    strict: bool,
    assign: bool = False,
) -> None:
    """Copy a verified checkpoint into the live objects of ``state`` (the last step); with
    ``assign`` the live objects take the (mapped) restored tensors instead."""
    manifest = opened.manifest
    pending = decode_value(manifest.state, PendingArray)
    if assign:
        tree = mapped_tree(state, pending, opened.reader)
    else:
        tree = place_and_materialize(state, pending, opened.reader)
    opened.release()
    apply(state, tree, manifest.state_kinds, strict=strict, validated=True, assign=assign)


def restore_candidates(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    candidates: list[int],
    *,
    fallback: bool,
    strict: bool = True,
    workers: int | None = None,
    full_only: bool = False,
    assign: bool = False,
) -> RestoreInfo:
    """Restore the first of ``candidates`` that verifies (see :meth:`RestorePlanner.restore`)."""
    return RestorePlanner(store, run, workers=workers).restore(
        state, candidates, fallback=fallback, strict=strict, full_only=full_only, assign=assign
    )


def restore(
    root: Root,
    state: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    strict: bool = True,
    missing_ok: bool = False,
    workers: int | None = None,
    collective: bool | None = None,
    assign: bool = False,
    progress: bool | ProgressFn | None = None,
    resume_from_light: bool = False,
    mem: bool | str = True,
) -> RestoreInfo | None:
    """Load checkpoint ``run@step`` into the live objects of ``state``.

    ``step="latest"`` takes the newest committed checkpoint that verifies completely; a
    damaged one is reported in ``RestoreInfo.skipped`` and the next older one is tried. An
    explicit step never falls back. A damaged object is moved to ``quarantine/`` so that
    no later save deduplicates against it. Everything is read and verified, and the
    checkpoint is checked against the live state (keys, shapes, dtypes, types), before
    anything in ``state`` is changed: a failed restore leaves the training state as it was.

    ``assign=True`` (for inference, evaluation or export jobs that read a checkpoint once):
    instead of copying into the live tensors, modules take the verified stored tensors
    themselves (``load_state_dict(assign=True)``; top-level tensors are replaced in
    ``state``). A tensor in one raw object of a local store is then a view of that object's
    private copy-on-write mapping: no copy, and writing to it (training it) never changes
    the store. Larger tensors and other codecs decode into fresh memory. Create optimizers
    after such a restore: the modules hold new parameter objects. Not for checkpoints
    written by several ranks.

    A light checkpoint (lossy: ``RestoreInfo.lossy``) is restored when its step is given,
    and by ``"latest"`` only with ``resume_from_light=True`` and no newer full checkpoint;
    one whose base is damaged or gone is reported in ``skipped`` like a damaged one.

    ``progress``: a ``progress(done, total)`` callback (stored bytes fetched and verified),
    True for a bar on stderr, False for none; None (default) draws a bar when the store (or
    a tier it reads from) is remote and stderr is a terminal.

    ``mem``: when this node holds the run's mem tier (a manager with ``tiers={"mem":
    ...}`` committed there; after a crash its newest steps may be only in memory), read it
    first, as the manager does: True looks under the default mem root
    (``$STEPVAULT_MEM_ROOT`` or ``/dev/shm/stepvault``), a path names the root, False
    reads the store's own tiers only.

    Returns None when the run has no checkpoint and ``missing_ok`` is true (a fresh start).
    Under a process group every rank calls it; a checkpoint saved on N ranks loads on M.
    """
    validate_run_name(run)
    if is_collective(state, collective):
        _no_assign(assign)
        return restore_collective(root, state, run, step, missing_ok, workers)
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    from ..tiers.view import read_view, read_workers, with_copies, with_mem_tier

    store = read_view(store)  # a store with cold tiers restores from any tier, hot first
    if mem is not False:  # this node's memory first, when it holds the run's mem tier
        store = with_mem_tier(store, run, None if mem is True else str(mem))
    planner = RestorePlanner(store, run, workers=workers or read_workers(store))
    with restore_progress(progress, store, f"restore {run}") as report:
        planner.progress = report
        if step == "latest":
            steps = store.list_steps(run)
            if not steps:
                if missing_ok:
                    return None
                raise CheckpointNotFoundError(
                    f"run {run!r} has no committed checkpoint in {store.backend.url} "
                    f"(runs: {', '.join(store.list_runs()) or 'none'})"
                )
            if planner.is_sharded(steps[-1]):
                _no_assign(assign)
                return restore_collective(store, state, run, step, missing_ok, planner.workers)
            # Like the manager: "latest" of a training state is the newest *full* checkpoint;
            # a state of modules alone also takes weights-only ones.
            full_only = any(not isinstance(v, torch.nn.Module) for v in state.values())
            # Kinds are checked as each candidate is opened (full_only): no manifest is read
            # ahead of the restore.
            chosen = choose_candidates(listed_records(run, steps), "latest", full_only=False)
            return planner.restore(
                state,
                with_copies(store, run, chosen.steps),  # a damaged copy: another tier's
                fallback=True,
                strict=strict,
                full_only=full_only,
                assign=assign,
                light=resume_from_light,
            )
        explicit = validate_step(step)
        if planner.is_sharded(explicit):
            _no_assign(assign)
            return restore_collective(store, state, run, step, missing_ok, planner.workers)
        copies = with_copies(store, run, [explicit])  # the same step, any tier
        return planner.restore(
            state, copies, fallback=len(copies) > 1, strict=strict, assign=assign, light=True
        )


@contextmanager
def restore_progress(
    progress: bool | ProgressFn | None, store: Store, description: str
) -> Iterator[ProgressFn | None]:
    """The progress callback of a restore: the caller's, a terminal bar (``True``, or by
    default when ``store`` reads from a remote tier: a slow restore), or None."""
    if callable(progress):
        yield progress
        return
    from ..tiers.view import read_workers

    if progress is False or (progress is None and read_workers(store) is None):
        yield None
        return
    with terminal_bar(description) as bar:
        yield bar


def _no_assign(assign: bool) -> None:
    if assign:
        raise ValueError(
            "restore(assign=True) reads checkpoints of one process; a checkpoint written by "
            "several ranks (or a restore under a process group) is restored in place: "
            "pass assign=False"
        )


def restore_collective(
    root: Root | Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int | Literal["latest"],
    missing_ok: bool,
    workers: int | None,
) -> RestoreInfo | None:
    """Every rank restores its part of ``run@step`` through DCP (resharding as needed)."""
    from ..distributed.api import restore_state
    from ..format import parse_manifest

    t0 = time.perf_counter()
    try:
        store = root if isinstance(root, Store) else Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    if step == "latest" and not store.list_steps(run):
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"run {run!r} has no committed checkpoint")
    chosen = restore_state(store, state, run=run, step=step, workers=workers)
    m = parse_manifest(store.read_manifest(run, chosen), f"{run}@{chosen}")
    return RestoreInfo.of_manifest(m, m.metadata, [], time.perf_counter() - t0)
