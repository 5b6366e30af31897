"""``CheckpointManager``: the one object a training loop talks to.

It decides *when* to save (save policy), writes without stalling training (only the copy
into reusable host buffers happens on the training thread), keeps what is worth keeping
(keep policy, then garbage collection), restores the newest checkpoint that verifies, and
records every save, restore, deletion and failure in the store's event log.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..api import (
    RestoreInfo,
    SaveInfo,
    new_manifest,
    open_store_for_writing,
    restore_candidates,
    write_manifest,
)
from ..distributed.state import distributed_active
from ..engine import to_host
from ..engine.attachments import add_attachments
from ..engine.background import BackgroundWriter
from ..engine.gc import DEFAULT_GRACE_SECONDS, sweep
from ..engine.staging_area import StagingArea
from ..errors import NoValidCheckpointError, StepvaultError
from ..format import parse_manifest
from ..lineage import Lineage, write_lineage
from ..policy import (
    CheckpointRecord,
    KeepAny,
    KeepBest,
    KeepPolicy,
    RetentionPlan,
    SaveContext,
    SaveDecision,
    SavePolicy,
    merge_decisions,
    plan_retention,
)
from ..state.snapshot import take_snapshot
from ..store import Store, validate_run_name, validate_step
from ..store.annotations import manifest_id, merged_metrics, read_annotations
from ..store.events import log_event, read_events
from ..store.lease import DEFAULT_STALE_AFTER, acquire_lease
from ..store.signing import Signer
from ..vault import CheckpointSummary, Vault

IfBusy = Literal["wait", "skip"]


@dataclass
class SaveHandle:
    """A save the manager started. ``result()`` waits for it and returns its SaveInfo."""

    step: int
    kind: str
    reason: str
    stall_seconds: float
    asynchronous: bool
    _future: Future | None = None
    _info: SaveInfo | None = None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """The committed save's :class:`SaveInfo` (raises the save's error, if it failed)."""
        if self._info is None and self._future is not None:
            self._info = self._future.result(timeout)
        assert self._info is not None
        return self._info


@dataclass
class _Stats:
    saves: int = 0
    failures: int = 0
    skipped_busy: int = 0
    stalls: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    new_bytes: int = 0
    logical_bytes: int = 0
    restores: int = 0
    restore_failures: int = 0
    fallbacks: int = 0
    deleted: int = 0
    freed_bytes: int = 0


class _SaveAlways(SavePolicy):
    """The default save policy: every call to ``save`` saves."""

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        return SaveDecision("full", "save() called")

    def __repr__(self) -> str:
        return "Always()"


def read_record(
    store: Store, run: str, step: int, annotations: list[dict[str, Any]] | None = None
) -> CheckpointRecord:
    """The keep-policy record of one checkpoint (``valid=False`` if its manifest is unreadable).

    Metrics attached later with ``stepvault annotate`` override those recorded at save time.
    """
    try:
        data = store.read_manifest(run, step)
        m = parse_manifest(data, f"{run}@{step}")
    except StepvaultError:
        return CheckpointRecord(step, 0.0, valid=False)
    mid = manifest_id(data)
    metrics = merged_metrics(dict(m.metrics), annotations or [], mid)
    return CheckpointRecord(step, m.created, metrics, m.kind, m.epoch, manifest_id=mid)


def checkpoint_records(
    store: Store, run: str, cache: dict[int, CheckpointRecord] | None = None
) -> list[CheckpointRecord]:
    """Keep-policy records of every committed checkpoint of ``run`` (pins, holds, annotations).

    A manifest that cannot be read gives a record with ``valid=False``. ``cache`` holds the
    records read from manifests; annotations are re-read on every call (one listing), so
    metrics attached by an evaluation job while training runs count at once.
    """
    cache = {} if cache is None else cache
    pinned = store.protected_steps(run)  # user pins and registry holds
    annotations = read_annotations(store, run)
    out = []
    for step in store.list_steps(run):
        rec = cache.get(step)
        if rec is None:
            rec = cache[step] = read_record(store, run, step)
        if step in annotations and rec.valid:
            rec = dataclasses.replace(
                rec, metrics=merged_metrics(rec.metrics, annotations[step], rec.manifest_id)
            )
        if (step in pinned) != rec.pinned:
            rec = dataclasses.replace(rec, pinned=step in pinned)
        out.append(rec)
    return out


class CheckpointManager:
    """Policies, asynchronous saves, retention and resume for one run.

    ::

        mgr = CheckpointManager("ckpts", run="exp1",
                                save=Every(steps=1000) | Every(minutes=30) | OnSignal(),
                                keep=KeepLast(3) | KeepBest(3, metric="val_loss"))
        info = mgr.restore(state)               # None on a fresh start
        for step in range(start, total):
            ...
            mgr.save(step, state, metrics={"loss": loss})
        mgr.close()

    Parameters:
        root: store location (created when absent).
        run: run name; one manager at a time may write it (a lease in the store).
        save: save policy (default: every ``save()`` call saves).
        keep: keep policy applied after every save (default: keep everything).
        async_save: write in a background thread; training waits only for the copy of
            tensors into reusable host buffers.
        if_busy: when a save is due while the previous one is still writing: ``"wait"``
            for it (default) or ``"skip"`` this one (counted in ``stats()``).
        codec: chunk codec for this run's saves (default: the store's setting).
        best_metric, best_mode: what "best" means for ``restore(step="best")`` and
            ``best_step`` (default: the metric of the first KeepBest in ``keep``).
        total_steps: lets ``LastStep()`` fire.
        gc_grace_seconds: unreferenced objects younger than this are never swept (they
            may belong to a save in flight in another process).
        lease_stale_after: seconds without a heartbeat after which another process may
            take over the run's lease (a crashed writer on this host is taken over at once).
        prometheus: True (default registry) or a ``CollectorRegistry`` to export metrics.
        on_save_error: ``"raise"`` (default) a failed save on the training thread, or
            ``"warn"``: emit a RuntimeWarning, log the event and let training go on (e.g. a
            full disk: better to keep training and retry at the next save).
        lineage: a :class:`~stepvault.Lineage` (``Lineage.capture(config, data=...,
            parent="base@1000")``) linked from every manifest; by default the git commit and
            environment are captured; ``False`` records nothing.
        signer: a :class:`~stepvault.Signer` that signs every manifest (default:
            ``$STEPVAULT_SIGNING_KEY`` when set).
        tiers: cold tiers, name -> URL/path (``{"archive": "s3://bucket/ckpts"}``), recorded
            in the store so restores and the CLI find them (default: those recorded).
        tier_policy: where checkpoints live, e.g. ``HotLast(3) | CopyEvery("archive",
            steps=5)`` (:mod:`stepvault.tiers`); a background mover applies it after each
            commit (training never waits; ``close()`` lets it finish). Restores read from
            any tier, hot first. See STORAGE.md.
        collective: None (default) makes the manager collective under a process group
            (every rank calls ``save``). ``False`` makes it rank-local: for trainers that
            save a replicated (DDP) model from rank 0 only (Lightning, the HF Trainer);
            sharded DTensor state is then refused.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Store,
        run: str,
        *,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        async_save: bool = True,
        if_busy: IfBusy = "wait",
        codec: str | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        total_steps: int | None = None,
        gc_grace_seconds: float = DEFAULT_GRACE_SECONDS,
        lease_stale_after: float = DEFAULT_STALE_AFTER,
        workers: int | None = None,
        prometheus: Any = False,
        on_save_error: Literal["raise", "warn"] = "raise",
        lineage: Lineage | Literal[False] | None = None,
        signer: Signer | None = None,
        tiers: Mapping[str, Any] | None = None,
        tier_policy: Any = None,
        collective: bool | None = None,
    ) -> None:
        if on_save_error not in ("raise", "warn"):
            raise ValueError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        self.on_save_error = on_save_error
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.run = validate_run_name(run)
        self.store = open_store_for_writing(root)
        if signer is not None:
            self.store.signer = signer
        # Lineage (config, git commit, data, environment, parent) is captured once per
        # session and linked from every manifest it commits; lineage=False records none.
        self.lineage: Lineage | None = Lineage.capture() if lineage is None else (lineage or None)
        self._lineage_digest: str | None = None
        self.save_policy: SavePolicy = save if save is not None else _SaveAlways()
        self.keep_policy = keep
        self.async_save = async_save
        self.if_busy = if_busy
        self.codec = codec
        self.total_steps = total_steps
        self.gc_grace_seconds = gc_grace_seconds
        self.workers = workers
        self._best = self._best_metrics(best_metric, best_mode)
        # Under a process group every rank has a manager; rank 0 holds the lease, logs
        # events and applies retention, and saves are collective (asynchronous through DCP's
        # async_save on a dedicated gloo group when async_save=True).
        if collective and not distributed_active():
            raise ValueError("collective=True needs an initialised torch.distributed group")
        self._dist = distributed_active() if collective is None else bool(collective)
        self._local_only = collective is False  # a rank-local manager under a process group
        self._rank = torch.distributed.get_rank() if self._dist else 0
        # Cold tiers (recorded in the store) and, with a tier policy, the background mover
        # (rank 0 only); restores read through the view: any tier, hot first. STORAGE.md.
        from ..tiers.hook import setup_tiers

        self._view, self.tier_mover = setup_tiers(
            self.store,
            self.run,
            tiers,
            tier_policy,
            coordinator=self._rank == 0,
            grace_seconds=gc_grace_seconds,
        )
        self._lease = self._acquire_lease(lease_stale_after)
        self._closed = False
        self._lock = threading.RLock()
        self._bg = BackgroundWriter() if async_save else None
        self._async_dist = None
        if async_save and self._dist:
            from ..distributed.api import AsyncSaver

            self._async_dist = AsyncSaver()  # collective: every rank builds its manager
        self._staging = StagingArea()
        self._stats = _Stats()
        self._records: dict[int, CheckpointRecord] = {}
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._save_cost: float | None = None
        self._pending_decision: tuple[tuple[int, int | None], SaveDecision | None] | None = None
        self._heartbeat_error: BaseException | None = None
        self._metrics = None
        if prometheus:
            from .metrics import PrometheusMetrics

            registry = None if prometheus is True else prometheus
            self._metrics = PrometheusMetrics(self.run, registry)
        try:
            self.save_policy.install()
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._stop = threading.Event()
        if self._lease is not None:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop,
                args=(lease_stale_after / 3,),
                daemon=True,
                name="stepvault-lease",
            )
            self._heartbeat.start()

    def _acquire_lease(self, stale_after: float) -> Any:
        if not self._dist:
            return acquire_lease(self.store, self.run, stale_after=stale_after)
        lease, error = None, None
        if self._rank == 0:
            try:
                lease = acquire_lease(self.store, self.run, stale_after=stale_after)
            except StepvaultError as exc:
                error = str(exc)
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None:  # every rank fails together, none hangs later
            from ..store.lease import LeaseHeldError

            raise LeaseHeldError(box[0])
        return lease

    # ----------------------------------------------------------------------------- helpers
    def _best_metrics(self, metric: str | None, mode: str) -> list[tuple[str, str]]:
        if metric is not None:
            return [(metric, mode)]
        found: list[tuple[str, str]] = []

        def walk(p: Any) -> None:
            if isinstance(p, KeepBest):
                found.append((p.metric, p.mode))
            elif isinstance(p, KeepAny):
                for q in p.policies:
                    walk(q)

        walk(self.keep_policy)
        return found

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._lease.renew()
            except BaseException as exc:  # surfaced on the training thread
                self._heartbeat_error = exc
                return

    def _check(self) -> None:
        """Raise a background failure (save, lease) on the training thread."""
        if self._closed:
            raise StepvaultError(f"CheckpointManager for run {self.run!r} is closed")
        if self._heartbeat_error is not None:
            exc, self._heartbeat_error = self._heartbeat_error, None
            raise exc
        if self._bg is not None:
            exc = self._bg.poll_error()
            if exc is not None:
                self._raise_or_warn(exc)

    def _raise_or_warn(self, exc: BaseException) -> None:
        """A failed save: raise it, or with ``on_save_error="warn"`` warn and go on."""
        if self.on_save_error == "warn" and isinstance(exc, Exception):
            warnings.warn(
                f"stepvault: a save of run {self.run!r} failed and training continues "
                f"(on_save_error='warn'); earlier checkpoints are intact: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        raise exc

    def _wait_quietly(self) -> SaveInfo | None:
        try:
            return self._bg.wait() if self._bg is not None else None
        except BaseException as exc:
            self._raise_or_warn(exc)
            return None

    def _event(self, event: str, **fields: Any) -> None:
        if self._rank != 0:
            return  # one event log per run: the coordinator writes it
        try:
            log_event(self.store, self.run, event, **fields)
        except OSError:
            pass  # the event log must never break training

    def _context(self, step: int, epoch: int | None) -> SaveContext:
        return SaveContext(
            step=step,
            epoch=epoch,
            now=time.monotonic(),
            last_save_step=self._last_save_step,
            last_save_time=self._last_save_time,
            save_cost=self._save_cost,
            total_steps=self.total_steps,
        )

    def _decide(self, step: int, epoch: int | None) -> SaveDecision | None:
        # should_save() then save() at one boundary ask once (and, under a process group,
        # gather once); a call with another epoch at the same step is a new question.
        if self._pending_decision is not None and self._pending_decision[0] == (step, epoch):
            return self._pending_decision[1]
        decision = self.save_policy.decide(self._context(step, epoch))
        if decision is not None and not decision.urgent and step == self._last_save_step:
            decision = None  # already saved (or just restored) at this step
        if self._dist:  # every rank must take the same decision (clocks, signals differ)
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, decision)
            decision = merge_decisions([d for d in everyone if d is not None])
        self._pending_decision = ((step, epoch), decision)
        return decision

    # ------------------------------------------------------------------------- saving
    def should_save(self, step: int, epoch: int | None = None) -> bool:
        """Whether the save policy wants a checkpoint at this step boundary.

        Calling it is optional (``save`` asks the policy itself); it lets a loop skip
        building expensive state when no save is due.
        """
        self._check()
        return self._decide(validate_step(step), epoch) is not None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        metadata: Any = None,
        force: bool = False,
        kind: str | None = None,
        attachments: Mapping[str, Any] | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` at ``step`` if the policy says so (always with ``force=True``).

        ``attachments`` maps file names to bytes or file paths (read now): small files
        stored with the checkpoint, e.g. ``{"config.json": model.config.to_json_string()
        .encode()}`` (see :mod:`stepvault.engine.attachments`).

        Returns None when no save is due, else a :class:`SaveHandle`. With ``async_save``
        it returns as soon as the tensors are copied to host buffers; the write, commit
        and retention run in the background. A preemption signal makes the save
        synchronous; if its policy says so, the process then exits (``SystemExit``).
        """
        self._check()
        validate_step(step)
        decision = self._decide(step, epoch)
        self._pending_decision = None
        if force or kind is not None:
            decision = SaveDecision(
                kind or (decision.kind if decision else "full"),
                decision.reason if decision else "forced",
                urgent=decision.urgent if decision else False,
                exit_code=decision.exit_code if decision else None,
            )
        if decision is None:
            return None
        ctx = self._context(step, epoch)
        if self._dist and attachments:  # issue 19: single-process (or rank-local) saves only
            raise ValueError("attachments are not supported by multi-rank saves yet")
        if self._dist:
            return self._save_collective(step, state, ctx, decision, epoch, metrics)
        if self._local_only:
            from ..api import _collective

            _collective(state, False)  # refuses sharded DTensor state with a clear error
        background = self._bg is not None and not decision.urgent
        if self._bg is not None and self._bg.busy:
            if background and self.if_busy == "skip":
                self._stats.skipped_busy += 1
                self._event("save_skipped", step=step, reason="previous save still in flight")
                return None
            self._wait_quietly()  # raises the previous save's error, if any
        t0 = time.perf_counter()
        try:
            snapshot = take_snapshot(state, kind=decision.kind)
            manifest = new_manifest(
                self.run,
                step,
                snapshot,
                epoch=epoch,
                kind=decision.kind,
                metrics=metrics,
                metadata=metadata,
                lineage=self._lineage_ref(),
            )
            add_attachments(self.store, manifest, attachments)  # issue 19: attachments
            if background:
                host = self._staging.stage(snapshot.arrays)
            else:
                host = {name: to_host(value) for name, value in snapshot.arrays.items()}
        except BaseException as exc:
            self._failed(step, exc)
            raise
        stall = time.perf_counter() - t0

        def job() -> SaveInfo:
            return self._write(manifest, host, decision, stall, background)

        handle = SaveHandle(step, decision.kind, decision.reason, stall, background)
        self._last_save_step = step
        self._last_save_time = ctx.now
        if background:
            handle._future = self._bg.submit(job)
        else:
            try:
                handle._info = job()
            except BaseException as exc:
                self._raise_or_warn(exc)
                return None
            handle.stall_seconds = time.perf_counter() - t0
            self._stats.stalls[-1] = handle.stall_seconds
        self.save_policy.saved(ctx, decision)
        self._save_cost = handle.stall_seconds
        if decision.exit_code is not None:
            self._event(
                "exit_after_save", step=step, exit_code=decision.exit_code, reason=decision.reason
            )
            self.close()
            raise SystemExit(decision.exit_code)
        return handle

    def _save_collective(
        self,
        step: int,
        state: Mapping[str, Any],
        ctx: SaveContext,
        decision: SaveDecision,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
    ) -> SaveHandle | None:
        """Every rank writes its shards; rank 0 commits, logs and applies retention.

        With ``async_save`` the training thread only stages each rank's shards into reused
        CPU buffers; the write and commit run in the background (DCP ``async_save`` on a
        dedicated gloo group). Every rank waits for the previous save before starting the
        next, so a failure surfaces on all ranks at the same call.
        """
        from ..api import _encode_metrics
        from ..state.snapshot import weights_only

        background = self._async_dist is not None and not decision.urgent
        self._wait_quietly()  # all ranks: the previous save is committed (or failed) first
        t0 = time.perf_counter()
        part = weights_only(state) if decision.kind == "weights" else state
        args = dict(
            run=self.run,
            step=step,
            epoch=epoch,
            metrics=_encode_metrics(metrics),
            codec=self.codec,
            workers=self.workers,
            lineage=self._lineage_ref() if self._rank == 0 else None,
        )
        try:
            if background:
                future = self._async_dist.save(self.store, part, **args)
            else:
                from ..distributed.api import save_state

                save_state(self.store, part, **args)
        except BaseException as exc:
            self._failed(step, exc)
            self._raise_or_warn(exc)
            return None
        stall = time.perf_counter() - t0
        handle = SaveHandle(step, decision.kind, decision.reason, stall, background)
        if background:

            def job() -> SaveInfo:
                try:
                    future.result()
                except BaseException as exc:
                    self._failed(step, exc)
                    raise
                return self._committed_collective(step, decision, stall, t0, background)

            handle._future = self._bg.submit(job)
        else:
            try:
                handle._info = self._committed_collective(step, decision, stall, t0, background)
            finally:
                torch.distributed.barrier()  # every rank sees the same store after the save
        self._last_save_step = step
        self._last_save_time = ctx.now
        self.save_policy.saved(ctx, decision)
        self._save_cost = stall  # what training pays per save (Young/Daly's C)
        if decision.exit_code is not None:
            self._event(
                "exit_after_save", step=step, exit_code=decision.exit_code, reason=decision.reason
            )
            self.close()
            raise SystemExit(decision.exit_code)
        return handle

    def _committed_collective(
        self, step: int, decision: SaveDecision, stall: float, t0: float, background: bool
    ) -> SaveInfo:
        """Bookkeeping after a multi-rank commit: stats, the event and (rank 0) retention."""
        m = parse_manifest(self.store.read_manifest(self.run, step), f"{self.run}@{step}")
        seconds = time.perf_counter() - t0
        info = SaveInfo(
            self.run,
            step,
            m.epoch,
            m.logical_bytes,
            m.stored_bytes,
            int(m.stats.get("new_bytes", 0)),
            len(m.objects),
            0,
            seconds,
            decision.kind,
        )
        self._count_save(info, stall)
        self._event(
            "save",
            step=step,
            kind=decision.kind,
            reason=decision.reason,
            asynchronous=background,
            world_size=torch.distributed.get_world_size(),
            logical_bytes=info.logical_bytes,
            stored_bytes=info.stored_bytes,
            new_bytes=info.new_bytes,
            stall_seconds=stall,
            write_seconds=seconds,
        )
        if self._rank == 0 and self.keep_policy is not None:
            self._apply_retention()  # store-only work: no collective, safe on a thread
        if self.tier_mover is not None:
            self.tier_mover.notify()
        return info

    def _count_save(self, info: SaveInfo, stall: float) -> None:
        with self._lock:
            s = self._stats
            s.saves += 1
            s.stalls.append(stall)
            s.writes.append(info.seconds)
            s.new_bytes += info.new_bytes
            s.logical_bytes += info.logical_bytes
            self._records.pop(info.step, None)  # re-read (with its manifest id) when needed

    def _lineage_ref(self) -> str | None:
        """Digest of this session's lineage record, stored on first use."""
        if self.lineage is None:
            return None
        if self._lineage_digest is None:
            self._lineage_digest = write_lineage(self.store, self.run, self.lineage)
        return self._lineage_digest

    def _failed(self, step: int, exc: BaseException) -> None:
        self._stats.failures += 1
        if self._metrics:
            self._metrics.failed()
        self._event("save_failed", step=step, error=f"{type(exc).__name__}: {exc}")

    def _write(
        self, manifest: Any, host: dict, decision: SaveDecision, stall: float, background: bool
    ) -> SaveInfo:
        try:
            info = write_manifest(
                self.store, manifest, host, codec=self.codec, overwrite=True, workers=self.workers
            )
        except BaseException as exc:
            self._failed(manifest.step, exc)
            raise
        self._count_save(info, stall)
        if self._metrics:
            self._metrics.saved(
                info.kind, stall, info.seconds, info.new_bytes, info.logical_bytes, info.step
            )
        self._event(
            "save",
            step=info.step,
            kind=info.kind,
            reason=decision.reason,
            asynchronous=background,
            logical_bytes=info.logical_bytes,
            stored_bytes=info.stored_bytes,
            new_bytes=info.new_bytes,
            stall_seconds=stall,
            write_seconds=info.seconds,
            throughput_bytes_per_s=info.throughput if math.isfinite(info.throughput) else None,
        )
        if self.keep_policy is not None:
            self._apply_retention()
        if self.tier_mover is not None:
            self.tier_mover.notify()  # copies/evictions run on the mover's thread
        return info

    def wait(self) -> SaveInfo | None:
        """Block until the save in flight (if any) is committed; raises its error
        (warns instead with ``on_save_error="warn"``)."""
        return self._wait_quietly()

    # ---------------------------------------------------------------------- retention
    def _record(self, step: int) -> CheckpointRecord:
        rec = self._records.get(step)
        if rec is None:
            rec = self._records[step] = read_record(self._view, self.run, step)
        return rec

    def _all_records(self) -> list[CheckpointRecord]:
        return checkpoint_records(self.store, self.run, self._records)

    def retention_plan(self) -> RetentionPlan:
        """What the keep policy would delete now, and which rule keeps each survivor."""
        return plan_retention(
            self._all_records(), self.keep_policy, now=time.time(), best_metrics=self._best
        )

    def _apply_retention(self) -> None:
        plan = self.retention_plan()
        if not plan.delete:
            return
        reasons = {e.step: e.reasons for e in plan.entries}
        delete = plan.delete
        if self.tier_mover is not None:  # never before the mover copied them to a cold tier
            owed = self.tier_mover.hold(delete)
            delete = [s for s in delete if s not in owed]
        for step in delete:
            self.store.delete_manifest(self.run, step)  # the checkpoint vanishes atomically
            self._records.pop(step, None)
            self._stats.deleted += 1
            self._event("delete", step=step, reasons=reasons.get(step, []))
        report = sweep(self.store, grace_seconds=self.gc_grace_seconds)
        self._stats.freed_bytes += report.freed_bytes
        self._event(
            "gc",
            deleted_objects=len(report.deleted),
            freed_bytes=report.freed_bytes,
            kept_in_grace=report.kept_in_grace,
        )

    def pin(self, step: int, note: str = "") -> None:
        """Protect ``step`` from every keep policy until :meth:`unpin`."""
        self.store.pin(self.run, step, note)
        self._event("pin", step=step, note=note)

    def unpin(self, step: int) -> None:
        self.store.unpin(self.run, step)
        self._event("unpin", step=step)

    # -------------------------------------------------------------------------- restore
    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | Literal["latest", "best"] = "latest",
        *,
        strict: bool = True,
    ) -> RestoreInfo | None:
        """Load a checkpoint into ``state``; None when the run has none (a fresh start).

        ``"latest"``: the newest full checkpoint that verifies, falling back past damaged
        ones (each reported in ``info.skipped``). ``"best"``: the best by the manager's
        metric, falling back to the next best. An int: exactly that step, no fallback.
        """
        self._check()
        self.wait()
        t0 = time.perf_counter()
        steps = self._view.list_steps(self.run)  # every tier's checkpoints
        if step == "latest":
            candidates = [
                s
                for s in reversed(steps)
                if self._record(s).kind == "full" or not self._record(s).valid
            ]
            fallback = True
        elif step == "best":
            if not self._best:
                raise ValueError(
                    "restore(step='best') needs a metric: pass best_metric= to the manager "
                    "or use a KeepBest keep policy"
                )
            metric, mode = self._best[0]
            scored = [
                r
                for r in self._all_records()  # annotated metrics count
                if r.valid
                and isinstance(r.metrics.get(metric), float)
                and math.isfinite(r.metrics[metric])
            ]
            scored.sort(
                key=lambda r: (r.metrics[metric] if mode == "min" else -r.metrics[metric], -r.step)
            )
            candidates = [r.step for r in scored]
            fallback = True
        else:
            candidates = [validate_step(step)]
            fallback = False
        if self._dist:  # rank 0's view of the candidates, so every rank tries the same ones
            box = [candidates]
            torch.distributed.broadcast_object_list(box, src=0)
            candidates = box[0]
        if self._view is not self.store and not self._dist:
            from ..tiers.view import with_copies

            # A damaged hot copy is quarantined, then the same step is read from a cold tier.
            candidates = with_copies(self._view, self.run, candidates)
            fallback = fallback or len(candidates) > 1
        if not candidates:
            self._event("restore", step=None, result="fresh start")
            return None
        try:
            if self._dist or any(
                self._record(c).kind == "full" and self._is_sharded(c) for c in candidates[:1]
            ):
                if self._local_only and distributed_active():
                    raise StepvaultError(
                        f"{self.run}@{candidates[0]} was saved by several ranks: restore it "
                        "on every rank with a collective manager (collective=None)"
                    )
                info = self._restore_collective(state, candidates, fallback)
            else:
                from ..tiers.view import read_workers

                info = restore_candidates(
                    self._view,
                    state,
                    self.run,
                    candidates,
                    fallback=fallback,
                    strict=strict,
                    workers=self.workers or read_workers(self._view),  # many on S3
                )
        except BaseException as exc:
            self._stats.restores += 1
            self._stats.restore_failures += 1
            skipped = getattr(exc, "skipped", [])
            self._stats.fallbacks += len(skipped)
            if self._metrics:
                self._metrics.restored(False, len(skipped))
            self._event(
                "restore_failed",
                requested=str(step),
                error=f"{type(exc).__name__}: {exc}",
                skipped=[{"step": s.step, "reason": s.reason} for s in skipped],
            )
            raise
        self._stats.restores += 1
        self._stats.fallbacks += len(info.skipped)
        if self._metrics:
            self._metrics.restored(True, len(info.skipped))
        for s in info.skipped:
            self._records.pop(s.step, None)
        self._last_save_step = info.step
        self._event(
            "restore",
            step=info.step,
            requested=str(step),
            skipped=[{"step": s.step, "reason": s.reason} for s in info.skipped],
            seconds=time.perf_counter() - t0,
            bytes_read=info.bytes_read,
        )
        return info

    def _is_sharded(self, step: int) -> bool:
        from ..api import _is_sharded

        return _is_sharded(self._view, self.run, step)  # in whichever tier holds it

    def _restore_collective(
        self, state: MutableMapping[str, Any], candidates: list[int], fallback: bool
    ) -> RestoreInfo:
        """Every rank loads its part (resharding as needed); all fall back together."""
        from ..api import RestoreInfo, SkippedCheckpoint
        from ..distributed.api import _is_damage, restore_state

        t0 = time.perf_counter()
        skipped: list[Any] = []
        for candidate in candidates:
            try:
                # Through the tier view: a checkpoint evicted from hot is read from a cold
                # tier by every rank (objects from the first tier that has them).
                chosen = restore_state(
                    self._view, state, run=self.run, step=candidate, workers=self.workers
                )
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                if not fallback or not _is_damage(exc):
                    raise
                skipped.append(SkippedCheckpoint(candidate, str(exc)))
                continue
            m = parse_manifest(self._view.read_manifest(self.run, chosen), f"{self.run}@{chosen}")
            return RestoreInfo(
                self.run,
                chosen,
                m.epoch,
                dict(m.metrics),
                m.metadata,
                m.created,
                m.kind,
                skipped=skipped,
                seconds=time.perf_counter() - t0,
                bytes_read=m.logical_bytes,
            )
        raise NoValidCheckpointError(
            f"no checkpoint of run {self.run!r} could be restored on every rank", skipped
        )

    # ----------------------------------------------------------------------- queries
    def checkpoints(self) -> list[CheckpointSummary]:
        """Every committed checkpoint of the run, oldest first."""
        return Vault(self.store).checkpoints(self.run)

    @property
    def latest_step(self) -> int | None:
        """Newest committed step (of any kind), or None."""
        steps = self.store.list_steps(self.run)
        return steps[-1] if steps else None

    @property
    def best_step(self) -> int | None:
        """Best step by the manager's metric, or None (no metric or no scored checkpoint)."""
        if not self._best:
            return None
        metric, mode = self._best[0]
        scored = [
            r for r in self._all_records() if r.valid and isinstance(r.metrics.get(metric), float)
        ]
        if not scored:
            return None
        best = (min if mode == "min" else max)(
            scored, key=lambda r: (r.metrics[metric], r.step if mode == "max" else -r.step)
        )
        return best.step

    def events(self) -> list[dict[str, Any]]:
        """The run's event log."""
        return read_events(self.store, self.run)

    def stats(self) -> dict[str, Any]:
        """Summary: saves, failures, stalls, bytes, restores and their success rate."""
        s = self._stats
        restores_ok = s.restores - s.restore_failures
        return {
            "saves": s.saves,
            "failures": s.failures,
            "skipped_busy": s.skipped_busy,
            "mean_stall_seconds": sum(s.stalls) / len(s.stalls) if s.stalls else 0.0,
            "max_stall_seconds": max(s.stalls, default=0.0),
            "mean_write_seconds": sum(s.writes) / len(s.writes) if s.writes else 0.0,
            "new_bytes": s.new_bytes,
            "logical_bytes": s.logical_bytes,
            "restores": s.restores,
            "restore_failures": s.restore_failures,
            "restore_success_rate": restores_ok / s.restores if s.restores else None,
            "fallbacks": s.fallbacks,
            "deleted_checkpoints": s.deleted,
            "freed_bytes": s.freed_bytes,
            "staging_bytes": self._staging.nbytes,
        }

    # ------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Wait for the save in flight, release the lease and signal handlers.

        Raises the in-flight save's error, if it failed (after cleaning up).
        """
        if self._closed:
            return
        error: BaseException | None = None
        try:
            if self._bg is not None:
                try:
                    self._wait_quietly()
                except BaseException as exc:
                    error = exc
                self._bg.shutdown()
            if self.tier_mover is not None:
                self.tier_mover.close()  # a last pass, while this process holds the lease
                if self.keep_policy is not None:
                    try:  # deletions deferred until the mover had copied those checkpoints
                        self._apply_retention()
                    except (StepvaultError, OSError):
                        pass  # the next session's first save applies it
        finally:
            self._closed = True
            self._stop.set()
            self.save_policy.uninstall()
            self._staging.release()
            if self._async_dist is not None:
                self._async_dist.close()
            try:
                if self._lease is not None:
                    self._lease.release()
            except OSError:
                pass
        if error is not None:
            raise error

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the training error with a save error
            try:
                self.close()
            except BaseException:
                pass

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.store.backend.url!r}, run={self.run!r}, "
            f"save={self.save_policy!r}, keep={self.keep_policy!r}, "
            f"async_save={self.async_save})"
        )


__all__ = ["CheckpointManager", "NoValidCheckpointError", "SaveHandle", "checkpoint_records"]
