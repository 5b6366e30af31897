"""The manager's restore: choose candidates from the catalog, agree on them across ranks,
then restore through the core's planner (or every rank through DCP for a multi-rank
checkpoint), recording the outcome."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any, Literal

from ..catalog import choose_candidates
from ..core.info import RestoreInfo, SkippedCheckpoint
from ..core.restore import RestorePlanner
from ..errors import NoValidCheckpointError
from ..format import parse_manifest
from ..store import validate_step
from .session import RunSession

StepRef = int | Literal["latest", "best"]


class ManagerRestorer:
    """Restores the manager's run into a live state."""

    def __init__(self, session: RunSession, best: list[tuple[str, str]]) -> None:
        self.session = session
        self.best = best
        #: a RankMemory (.rank_memory): "latest" or a step is first restored from node memory
        self.memory: Any = None
        #: the restore's progress: a callback, True/False, or None (a bar on a terminal
        #: when reading from a remote tier), as in :func:`stepvault.restore`
        self.progress: Any = None

    def candidates(self, step: StepRef) -> tuple[list[int], bool]:
        """``(steps to try in order, may fall back)`` for ``step`` (rank 0's, shared)."""
        s = self.session
        if step == "latest":
            chosen = choose_candidates(  # every tier's
                s.all_tier_records(), "latest", light=s.options.resume_from_light
            )
        elif step == "best":
            if not self.best:
                raise ValueError(
                    "restore(step='best') needs a metric: pass best_metric= to the manager "
                    "or use a KeepBest keep policy"
                )
            chosen = choose_candidates(s.records(), "best", best=self.best[0])  # annotated
        else:
            chosen = choose_candidates([], validate_step(step))
        candidates, fallback = s.scope.share(chosen.steps), chosen.fallback
        if s.view is not s.store and not s.scope.collective:
            from ..tiers.view import with_copies

            # A damaged hot copy is quarantined, then the same step is read from a cold tier.
            candidates = with_copies(s.view, s.run, candidates)
            fallback = fallback or len(candidates) > 1
        return candidates, fallback

    def restore(
        self, state: MutableMapping[str, Any], step: StepRef, *, strict: bool, assign: bool = False
    ) -> RestoreInfo | None:
        s = self.session
        t0 = time.perf_counter()
        candidates, fallback = self.candidates(step)
        if self.memory is not None and step != "best":
            if step == "latest":
                info = self.memory.restore(state, max(candidates) if candidates else None)
            else:  # that step, from memory when every rank can get it there
                info = self.memory.restore(state, None, step=validate_step(step))
            if info is not None:  # own or the buddy's memory; every rank the same step
                return self._restored_from_memory(info, t0, str(step))
        if not candidates:
            s.event("restore", step=None, result="fresh start")
            return None
        reset = getattr(s.view, "reset_served", None)
        if reset is not None:
            reset()  # the view counts bytes per tier: which one the restore came from
        try:
            # an explicit step may be a light one; "latest"/"best" only when the manager says so
            light = s.options.resume_from_light or not isinstance(step, str)
            info = self._restore(state, candidates, fallback, strict, assign, light)
        except BaseException as exc:
            skipped = getattr(exc, "skipped", [])
            s.stats.restored(False, len(skipped))
            if s.metrics:
                s.metrics.restored(False, len(skipped))
            s.event(
                "restore_failed",
                requested=str(step),
                error=f"{type(exc).__name__}: {exc}",
                skipped=[{"step": k.step, "reason": k.reason} for k in skipped],
            )
            raise
        served = dict(getattr(s.view, "served", {}))
        info.tier_bytes = served
        info.tier = max(served, key=lambda t: served[t]) if served else "hot"
        s.stats.restored(True, len(info.skipped))
        if s.metrics:
            s.metrics.restored(True, len(info.skipped))
        for k in info.skipped:
            s.forget(k.step)
        s.event(
            "restore",
            step=info.step,
            requested=str(step),
            skipped=[{"step": k.step, "reason": k.reason} for k in info.skipped],
            seconds=time.perf_counter() - t0,
            bytes_read=info.bytes_read,
            tier=info.tier,
            tier_bytes=info.tier_bytes,
            **({"lossy": True, "base_step": info.base_step} if info.lossy else {}),
        )
        return info

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

    def _restore(
        self,
        state: MutableMapping[str, Any],
        candidates: list[int],
        fallback: bool,
        strict: bool,
        assign: bool = False,
        light: bool = False,
    ) -> RestoreInfo:
        s = self.session
        if assign and s.scope.collective:
            raise ValueError("restore(assign=True) is for one process; pass assign=False")
        if s.scope.collective:
            return self._restore_collective(state, candidates, fallback)
        from ..tiers.view import read_workers

        planner = RestorePlanner(
            s.view,
            s.run,
            workers=s.options.workers or read_workers(s.view),  # many on S3
        )
        first = candidates[0]
        if planner.is_sharded(first) and planner.open(first).manifest.kind == "full":
            s.scope.check_restore(s.run, first)
            return self._restore_collective(state, candidates, fallback)
        from ..core.restore import restore_progress

        with restore_progress(self.progress, s.view, f"restore {s.run}") as report:
            planner.progress = report
            return planner.restore(
                state,
                candidates,
                fallback=fallback,
                strict=strict,
                assign=assign,
                light=light,
            )

    def _restore_collective(
        self, state: MutableMapping[str, Any], candidates: list[int], fallback: bool
    ) -> RestoreInfo:
        """Every rank loads its part (resharding as needed); all fall back together."""
        from ..distributed.api import _is_damage, restore_state

        s = self.session
        t0 = time.perf_counter()
        skipped: list[SkippedCheckpoint] = []
        for candidate in candidates:
            try:
                # Through the tier view: a checkpoint evicted from hot is read from a cold
                # tier by every rank (objects from the first tier that has them).
                chosen = restore_state(
                    s.view, state, run=s.run, step=candidate, workers=s.options.workers
                )
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                if not fallback or not _is_damage(exc):
                    raise
                skipped.append(SkippedCheckpoint(candidate, str(exc)))
                continue
            m = parse_manifest(s.view.read_manifest(s.run, chosen), f"{s.run}@{chosen}")
            return RestoreInfo.of_manifest(m, m.metadata, skipped, time.perf_counter() - t0)
        raise NoValidCheckpointError(
            f"no checkpoint of run {s.run!r} could be restored on every rank", skipped
        )
