"""The one restore planner: sources → candidates → open once → check → verify → place.

Every restore goes through here: :func:`stepvault.restore`, the manager's restorer, the
integrations' ``read_checkpoint`` and the memory restore of a process group
(:mod:`.peer_restore`, which agrees on a step across ranks first, then restores it here).

- A :class:`Source` is where one run's checkpoints are read: a plain store, or the tier
  view (every tier, hot first; this node's mem tier first when it holds the run). It
  lists the records the candidates are chosen from (the listing alone, or records with
  kinds and metrics, as the manager and the integrations have them).
- :meth:`Source.choose` applies the one set of rules (:func:`stepvault.catalog.
  choose_candidates`): ``"latest"`` newest first with fallback, full checkpoints only
  unless light ones are allowed; ``"best"`` by a metric; a step exactly, no fallback.
- :class:`RestorePlanner` tries them in order: each candidate is opened once (one
  manifest parse), checked against the live state before a byte of tensor data is read
  (a mismatch raises :class:`StateMismatchError` and never falls back), verified
  completely (damage is quarantined, reported as a :class:`SkippedCheckpoint`, and the
  next candidate tried), and only then placed into the live state (invariant 4).
- Under a process group (or for a checkpoint written by several ranks)
  :func:`restore_offer` does the same on every rank: rank 0 chooses, the candidates and
  the first one's manifest bytes are shared in one broadcast, each rank parses that
  manifest once, and the ranks agree that the state fits and that every object verified
  before any rank changes its state (:mod:`stepvault.distributed.agreement`,
  :mod:`stepvault.distributed.restoring`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Literal

from .._progress import ProgressFn, terminal_bar
from .._rank import world_size
from ..catalog.records import Candidates, checkpoint_records, choose_candidates, listed_records
from ..catalog.thinning import explain_weights_only
from ..engine import PendingArray
from ..errors import (
    CorruptObjectError,
    IntegrityError,
    NoValidCheckpointError,
    StateMismatchError,
    StepvaultError,
    StoreVersionError,
)
from ..format import Manifest, decode_value
from ..format.record import CheckpointRecord
from ..state import apply, validate
from ..state.assigning import mapped_tree
from ..state.placement import place_and_materialize
from ..store import Store, validate_step
from .info import RestoreInfo, SkippedCheckpoint
from .light import place_light, prepare_light
from .opened import OpenedCheckpoint, open_checkpoint

StepRef = int | Literal["latest", "best"]


class Source:
    """One run's checkpoints where a restore reads them.

    ``store``: a plain store, or a tier view (reads any tier, hot first; this node's mem
    tier first: :func:`stepvault.tiers.view.with_mem_tier`). ``records``: the run's
    records with kinds and metrics (the manager's, from the summary cache); None: the
    listing alone, and each candidate's kind is checked when it is opened (no manifest is
    read ahead of the restore). ``scored``: the records ``"best"`` is chosen from (default:
    ``records``, else :func:`stepvault.catalog.checkpoint_records`).
    """

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        records: Callable[[], list[CheckpointRecord]] | None = None,
        scored: Callable[[], list[CheckpointRecord]] | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self._records = records
        self._scored = scored or records

    def choose(
        self,
        step: StepRef,
        *,
        best: tuple[str, str] | None = None,
        light: bool = False,
        full_only: bool = True,
    ) -> Candidates:
        """The steps to try, in order, and whether damage falls back (the catalog's
        rules). ``full_only``: ``"latest"`` passes over weights-only checkpoints; light
        ones only with ``light`` (and never one older than a full candidate)."""
        if step == "best":
            if best is None:
                raise ValueError(
                    "restore(step='best') needs a metric: pass best_metric= to the manager "
                    "or use a KeepBest keep policy"
                )
            scored = self._scored() if self._scored else checkpoint_records(self.store, self.run)
            return choose_candidates(scored, "best", best=best)
        if step == "latest":
            if self._records is None:
                # Kinds are unknown from a listing: the planner checks each one it opens.
                records = listed_records(self.run, self.store.list_steps(self.run))
                return choose_candidates(records, "latest", full_only=False)
            return choose_candidates(self._records(), "latest", full_only=full_only, light=light)
        return choose_candidates([], validate_step(step))

    def with_copies(self, chosen: Candidates) -> Candidates:
        """Each step once per tier that holds it: a damaged hot copy is quarantined, then
        the same step is read from the next tier before an older step is tried."""
        from ..tiers.view import with_copies

        steps = with_copies(self.store, self.run, chosen.steps)
        return Candidates(steps, chosen.fallback or len(steps) > len(chosen.steps))

    def reader_workers(self, workers: int | None) -> int | None:
        """Reader threads: the caller's, else many for a remote tier (the engine's default
        otherwise)."""
        from ..tiers.view import read_workers

        return workers or read_workers(self.store)


class RestorePlanner:
    """Restores one run of ``store``: every candidate is opened at most once."""

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        workers: int | None = None,
        progress: ProgressFn | None = None,
        verify: str = "fast",
    ) -> None:
        self.store = store
        self.run = run
        self.workers = workers
        #: "fast" (segment checksums where recorded) or "full" (BLAKE3 of every object)
        self.verify = verify
        #: ``progress(done, total)`` while a candidate's objects are fetched and verified
        self.progress = progress
        self._opened: dict[int, OpenedCheckpoint] = {}

    def open(self, step: int) -> OpenedCheckpoint:
        """``run@step`` opened (and kept: choosing and restoring it parse it once)."""
        opened = self._opened.get(step)
        if opened is None:
            opened = self._opened[step] = open_checkpoint(
                self.store, self.run, step, workers=self.workers, verify=self.verify
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
        ``assign``: see :func:`stepvault.restore`. ``light``: a light checkpoint may be
        restored (base + decoded deltas, ``RestoreInfo.lossy``), but never one older than
        a full candidate already tried; without it light ones are passed over (not
        reported).
        """
        t0 = time.perf_counter()
        skipped: list[SkippedCheckpoint] = []
        weights_only_steps: list[int] = []
        seen_full = False
        for candidate in candidates:
            prepared = None
            try:
                opened = self._opened.pop(candidate, None) or open_checkpoint(
                    self.store, self.run, candidate, workers=self.workers, verify=self.verify
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


def restore_local(
    source: Source,
    state: MutableMapping[str, Any],
    chosen: Candidates,
    *,
    strict: bool = True,
    full_only: bool = False,
    assign: bool = False,
    light: bool = False,
    workers: int | None = None,
    progress: bool | ProgressFn | None = None,
    on_sharded: Callable[[int], None] | None = None,
    verify: str = "fast",
) -> RestoreInfo:
    """Restore the first of ``chosen`` that fits and verifies, in this process.

    A checkpoint written by several ranks (the newest candidate's manifest says so) is
    handed to :func:`restore_offer` with that manifest, parsed once (under a process
    group: in this process alone, :mod:`.rank_local`); ``on_sharded(step)`` may refuse it
    first (``assign=True``). ``verify``: ``"fast"`` or ``"full"`` (:class:`RestorePlanner`).
    """
    if not chosen.steps:
        raise NoValidCheckpointError(f"run {source.run!r} has no checkpoint to restore")
    planner = RestorePlanner(
        source.store, source.run, workers=source.reader_workers(workers), verify=verify
    )
    first = chosen.steps[0]
    if planner.is_sharded(first):
        if on_sharded is not None:
            on_sharded(first)
        from ..distributed.agreement import Offer

        offer = Offer(chosen.steps, chosen.fallback, planner.open(first).manifest)
        planner.forget(first)
        restore = restore_offer
        if world_size() > 1:  # a DDP rank: this process alone, no rank of the group joins
            from .rank_local import restore_rank_local as restore
        return restore(source, state, offer, strict=strict, workers=planner.workers)
    copies = source.with_copies(chosen)
    with restore_progress(progress, source.store, f"restore {source.run}") as report:
        planner.progress = report
        return planner.restore(
            state,
            copies.steps,
            fallback=copies.fallback,
            strict=strict,
            full_only=full_only,
            assign=assign,
            light=light,
        )


def share_choice(source: Source, choose: Callable[[], Candidates]) -> Any:
    """Collective: rank 0 runs ``choose()``; every rank gets its candidates and the first
    one's manifest bytes in one broadcast (a :class:`stepvault.distributed.agreement.Offer`)."""
    from ..distributed.agreement import share_offer

    def steps() -> tuple[list[int], bool]:
        chosen = choose()
        return chosen.steps, chosen.fallback

    return share_offer(source.store, source.run, steps)


def restore_offer(
    source: Source,
    state: MutableMapping[str, Any],
    offer: Any,
    *,
    strict: bool = True,
    workers: int | None = None,
) -> RestoreInfo:
    """Collective: every rank restores the first candidate of ``offer`` that fits and
    verifies on every rank (resharding as needed), all falling back together; each tried
    manifest is parsed once per rank."""
    from ..distributed.agreement import try_candidates
    from ..distributed.restoring import restore_checkpoint

    t0 = time.perf_counter()

    def attempt(step: int, manifest: Manifest) -> None:
        restore_checkpoint(
            source.store, state, source.run, step, manifest, workers=workers, strict=strict
        )

    _, manifest, skipped = try_candidates(source.store, source.run, offer, attempt)
    metadata = decode_value(manifest.metadata, lambda kind, name: None)
    return RestoreInfo.of_manifest(
        manifest,
        metadata,
        [SkippedCheckpoint(step, reason) for step, reason in skipped],
        time.perf_counter() - t0,
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


__all__ = [
    "RestorePlanner",
    "Source",
    "place",
    "restore_local",
    "restore_offer",
    "restore_progress",
    "share_choice",
]
