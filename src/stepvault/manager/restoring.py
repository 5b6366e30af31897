"""The manager's restore: the core's one planner over the manager's sources (node memory
of every rank and its buddy, first; then the tier view), recording the outcome.

Candidates come from the session's records (summary cache, every tier) by the catalog's
rules; under a process group rank 0 chooses and the candidates reach every rank with the
first one's manifest in one broadcast (:func:`stepvault.core.planner.share_choice`), used
by the memory restore and the disk restore alike."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any, Literal

from ..catalog import Candidates
from ..core.info import RestoreInfo
from ..core.planner import Source, restore_local, restore_offer, share_choice
from ..store import validate_step
from .session import RunSession

StepRef = int | Literal["latest", "best"]


class ManagerRestorer:
    """Restores the manager's run into a live state."""

    def __init__(
        self, session: RunSession, best: list[tuple[str, str]], *, memory: Any = None
    ) -> None:
        self.session = session
        self.best = best
        #: a RankMemory (.rank_memory): "latest" or a step is first restored from node memory
        self.memory = memory

    def source(self) -> Source:
        """The run through the tier view; "latest" from every tier's records, "best" from
        the hot store's annotated ones."""
        s = self.session
        return Source(s.view, s.run, records=s.all_tier_records, scored=s.records)

    def choose(self, step: StepRef) -> Candidates:
        """What a restore of ``step`` tries (this rank's view; see :meth:`restore`)."""
        return self.source().choose(
            step,
            best=self.best[0] if self.best else None,
            light=self.session.options.resume_from_light,
        )

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: StepRef,
        *,
        strict: bool,
        assign: bool = False,
        progress: Any = None,
    ) -> RestoreInfo | None:
        """Restore ``step`` into ``state``. ``progress``: a callback, True/False, or None
        (a bar on a terminal when reading from a remote tier), as in
        :func:`stepvault.restore`."""
        s = self.session
        t0 = time.perf_counter()
        # Checked on every rank before any collective, so that no rank waits for another.
        if step == "best" and not self.best:
            raise ValueError(
                "restore(step='best') needs a metric: pass best_metric= to the manager "
                "or use a KeepBest keep policy"
            )
        if step not in ("latest", "best"):
            validate_step(step)
        if assign and s.scope.collective:
            raise ValueError("restore(assign=True) is for one process; pass assign=False")
        # A state this manager could never save (DTensors under a one-rank group without
        # collective=True) is refused now, not at the first due save after hours of training.
        s.scope.check_state(state)
        source = self.source()
        offer = None
        if s.scope.collective:  # rank 0 chooses; one broadcast with the first manifest
            offer = share_choice(source, lambda: self.choose(step))
            chosen = Candidates(offer.steps, offer.fallback)
        else:
            chosen = self.choose(step)
        if self.memory is not None and step != "best":
            if step == "latest":
                info = self.memory.restore(state, max(chosen.steps) if chosen.steps else None)
            else:  # that step, from memory when every rank can get it there
                info = self.memory.restore(state, None, step=validate_step(step))
            if info is not None:  # own or the buddy's memory; every rank the same step
                return self._restored_from_memory(info, t0, str(step))
        if not chosen.steps:
            s.event("restore", step=None, result="fresh start")
            return None
        reset = getattr(s.view, "reset_served", None)
        if reset is not None:
            reset()  # the view counts bytes per tier: which one the restore came from
        try:
            if offer is not None:
                info = restore_offer(source, state, offer, strict=strict, workers=s.options.workers)
            else:
                info = restore_local(
                    source,
                    state,
                    chosen,
                    strict=strict,
                    assign=assign,
                    # an explicit step may be a light one; "latest"/"best" only when the
                    # manager says so
                    light=s.options.resume_from_light or not isinstance(step, str),
                    workers=s.options.workers,
                    progress=progress,
                    on_sharded=lambda first: s.scope.check_restore(s.run, first),
                )
        except BaseException as exc:
            skipped = getattr(exc, "skipped", [])
            s.stats.restored(False, len(skipped))
            if s.metrics:
                s.metrics.restored(False, len(skipped))
            s.event(
                "restore_failed",
                requested=str(step),
                error=f"{type(exc).__name__}: {exc}",
                skipped=[_skipped_json(k) for k in skipped],
            )
            raise
        served = dict(getattr(s.view, "served", {}))
        info.tier_bytes = served
        info.tier = max(served, key=lambda t: served[t]) if served else "hot"
        record_restored(
            s,
            info,
            step,
            t0,
            bytes_read=info.bytes_read,
            tier=info.tier,
            tier_bytes=info.tier_bytes,
            **({"lossy": True, "base_step": info.base_step} if info.lossy else {}),
        )
        if isinstance(step, int):  # an explicit older step: training goes on from there
            self._warn_rewind(info.step)
        return info

    def _warn_rewind(self, restored: int) -> None:
        """A restore of an older step than the run's newest (``resume_from_checkpoint`` of
        an earlier one): the saves from here replace the newer checkpoints
        one by one, and until they do, "latest" is still the abandoned timeline's newest."""
        newer = sorted(
            st for st in set(self.session.view.list_steps(self.session.run)) if st > restored
        )
        if not newer:
            return
        import warnings

        shown = ", ".join(map(str, newer[:8])) + (", ..." if len(newer) > 8 else "")
        self.session.event("rewind", step=restored, newer=newer[:100])
        warnings.warn(
            f"run {self.session.run!r}: restored step {restored}, but the run has newer "
            f"checkpoints ({shown}): each save from here replaces the one of its step, and "
            f"until step {newer[-1]} is saved again, 'latest' (a restart after a crash) "
            "is the older timeline's; to branch cleanly, train on under a new run name",
            RuntimeWarning,
            stacklevel=3,
        )

    def _restored_from_memory(self, info: RestoreInfo, t0: float, requested: str) -> RestoreInfo:
        s = self.session
        info.tier_bytes = {str(info.tier): info.bytes_read}
        s.stats.restored(True, len(info.skipped))
        if s.metrics:
            s.metrics.restored(True, len(info.skipped))
        s.event(
            "restore",
            step=info.step,
            requested=requested,
            skipped=[{"step": k.step, "reason": k.reason} for k in info.skipped],
            seconds=time.perf_counter() - t0,
            bytes_read=info.bytes_read,
            tier=info.tier,
            tier_bytes=info.tier_bytes,
            rank_tiers=list(getattr(self.memory, "last_tiers", [])),
        )
        return info


def record_restored(
    session: RunSession, info: RestoreInfo, step: Any, t0: float, **fields: Any
) -> None:
    """What every resume records once it has loaded ``info``: stats, metrics, the skipped
    steps forgotten, and the run's ``restore`` event (``fields`` added to it)."""
    session.stats.restored(True, len(info.skipped))
    if session.metrics:
        session.metrics.restored(True, len(info.skipped))
    for k in info.skipped:
        session.forget(k.step)
    session.event(
        "restore",
        step=info.step,
        requested=str(step),
        skipped=[{"step": k.step, "reason": k.reason} for k in info.skipped],
        seconds=time.perf_counter() - t0,
        **fields,
    )


def _skipped_json(k: Any) -> dict[str, Any]:
    """A skipped checkpoint in an event (a SkippedCheckpoint, or a collective (step, reason))."""
    if isinstance(k, tuple):
        return {"step": k[0], "reason": k[1]}
    return {"step": k.step, "reason": k.reason}
