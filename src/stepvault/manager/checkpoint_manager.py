"""``CheckpointManager``: the one object a training loop talks to.

It is a coordinator: it decides *when* to save (save policy), hands a due save to the save
pipeline (:mod:`.saving`: only the copy into reusable host buffers happens on the training
thread), runs the after-commit hooks (:mod:`.hooks`: retention and GC, the tier mover),
restores through the restore planner (:mod:`.restoring`) and records every save, restore,
deletion and failure in the store's event log. What differs between one process and every
rank of a process group is one strategy object chosen at construction (:mod:`.scope`).

(Its length is the public class and its documented options; the work is in the modules
named above.)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

from ..catalog import CheckpointRecord, checkpoint_records, choose_candidates
from ..catalog.events import read_events
from ..catalog.lineage import Lineage
from ..catalog.refs import newest_full_step
from ..catalog.vault import Vault
from ..core.info import RestoreInfo, SaveInfo
from ..core.light import LightOptions
from ..core.write import open_store_for_writing
from ..engine.background import BackgroundWriter
from ..engine.gc import DEFAULT_GRACE_SECONDS
from ..engine.staging_pool import StagingPool
from ..errors import LeaseLostError, NoValidCheckpointError, StepvaultError
from ..policy import KeepPolicy, RetentionPlan, SaveContext, SaveDecision, SavePolicy
from ..store import Store, validate_run_name, validate_step
from ..store.lease import DEFAULT_STALE_AFTER
from ..store.signing import Signer
from .hooks import NotifyMover, Retention, tracked_best
from .options import IfBusy, ManagerOptions
from .preparing import RESERVE, readable_part, still_growing
from .restoring import ManagerRestorer
from .saving import AfterCommit, CollectiveWriter, LocalWriter, SavePipeline
from .scope import choose_scope
from .session import RunSession
from .stats import SaveHandle
from .sweeping import Sweeper


class _SaveAlways(SavePolicy):
    """The default save policy: every call to ``save`` saves."""

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        return SaveDecision("full", "save() called")

    def __repr__(self) -> str:
        return "Always()"


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
            tensors into reusable host buffers. The buffers are allocated and pre-faulted
            in the background as soon as the manager sees the state (``restore()``, a
            ``save()`` call that is not due, or :meth:`prepare`); a save due before they
            are ready is written synchronously (it stalls as long as a synchronous save).
        staging_memory: host memory for those buffers, bytes or a size (``"8GB"``,
            ``"512MiB"``). Each save in flight holds one copy of the state, so up to
            ``staging_memory // state size`` saves (at most 4) may be in flight; when
            that many are, a due save waits for the oldest (or is skipped with
            ``if_busy="skip"``). A state larger than the budget is saved synchronously,
            with a warning. Default: one copy (one save in flight).
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
        lineage: a :class:`~stepvault.registry.Lineage` (``Lineage.capture(config, data=...,
            parent="base@1000")``) linked from every manifest; by default the git commit and
            environment are captured; ``False`` records nothing.
        signer: a :class:`~stepvault.signing.Signer` that signs every manifest (default:
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
        light: how light saves (``what="light"`` in the save policy, or
            ``save(kind="light")``) encode the state: a :class:`~stepvault.LightOptions`.
        resume_from_light: let ``restore("latest")`` take a light checkpoint (lossy:
            ``info.lossy``) when it is newer than every full one (default: full ones only).
        replicate: under a process group with a mem tier (``tiers={"mem": True}``): every
            rank also saves its own state into its node's memory at each save, replicated
            in the background to a buddy node; ``restore()`` reads own memory, then the
            buddy's, then disk (:mod:`stepvault.manager.rank_memory`, STORAGE.md).
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
        staging_memory: int | str | None = None,
        mem_budget: int | str | None = None,
        mem_cleanup: bool = True,
        light: LightOptions | None = None,
        resume_from_light: bool = False,
        replicate: bool = False,
    ) -> None:
        # Every option is checked here, before the store is touched.
        self.options = opts = ManagerOptions(
            async_save=async_save,
            if_busy=if_busy,
            codec=codec,
            best_metric=best_metric,
            best_mode=best_mode,
            total_steps=total_steps,
            gc_grace_seconds=gc_grace_seconds,
            lease_stale_after=lease_stale_after,
            workers=workers,
            on_save_error=on_save_error,
            collective=collective,
            staging_memory=staging_memory,
            mem_budget=mem_budget,
            mem_cleanup=mem_cleanup,
            light=light,
            resume_from_light=resume_from_light,
        )
        self.run = validate_run_name(run)
        self.save_policy: SavePolicy = save if save is not None else _SaveAlways()
        scope = choose_scope(collective)
        self.store = open_store_for_writing(root)
        if signer is not None:
            self.store.signer = signer
        # Cold tiers (recorded in the store) and, with a tier policy, the background mover
        # (the coordinator only); restores read through the view: any tier, hot first.
        from ..tiers.hook import setup_tiers
        from .mem_saving import open_for_manager, split_mem

        tiers, mem_target = split_mem(tiers)
        if replicate and (mem_target is None or not scope.collective):
            raise ValueError(
                "replicate=True copies every rank's memory checkpoints to a buddy node: it "
                "needs a mem tier (tiers={'mem': True}) and a collective manager under an "
                "initialised process group"
            )
        #: the mem tier (node shared memory, read first; see .mem_saving), or None
        self.mem_tier = (
            open_for_manager(self.store, self.run, mem_target, opts.mem_budget)  # type: ignore[arg-type]
            if mem_target is not None
            else None
        )
        view, self.tier_mover = setup_tiers(
            self.store,
            self.run,
            tiers,
            tier_policy,
            coordinator=scope.coordinator,
            grace_seconds=gc_grace_seconds,
            mem=self.mem_tier.store if self.mem_tier is not None else None,
        )
        # Lineage (config, git commit, data, environment, parent) is captured once per
        # session and linked from every manifest it commits; lineage=False records none.
        self.lineage: Lineage | None = Lineage.capture() if lineage is None else (lineage or None)
        self._session = s = RunSession(
            self.store, view, self.run, opts, scope, lineage=self.lineage
        )
        self._lease = scope.acquire_lease(self.store, self.run, lease_stale_after)
        self._closed = False
        self._best = tracked_best(keep, best_metric, best_mode)
        self._staging = StagingPool(opts.staging_memory)  # type: ignore[arg-type]
        self._prepared_final = False  # prepared from the state as it will be saved
        writer = (
            CollectiveWriter(s, async_save) if scope.collective else LocalWriter(s, self._staging)
        )
        self._mem_saver = None
        if self.mem_tier is not None:
            from .mem_saving import MemSaver, start_mem_tier

            self._mem_saver = MemSaver(s, self.mem_tier, tier_policy, cleanup=mem_cleanup)
            if replicate and isinstance(writer, CollectiveWriter):
                from .rank_memory import RankMemory

                writer.mem = RankMemory(s, self.mem_tier, tier_policy, cleanup=mem_cleanup)
            start_mem_tier(s, self.mem_tier, writer, self._lease is not None)
            if isinstance(writer, LocalWriter):
                writer.mem = self._mem_saver
        # Retention deletes manifests after each commit; their objects are swept off the
        # commit path (.sweeping), by the coordinator (the one that applies retention).
        self._sweeper = Sweeper(s) if scope.coordinator else None
        self._retention = Retention(s, keep, self._best, self.tier_mover, self._sweeper)
        hooks: list[AfterCommit] = [self._retention]
        if self.tier_mover is not None:
            hooks.append(NotifyMover(self.tier_mover))
        self._pipeline = SavePipeline(s, writer, BackgroundWriter() if async_save else None, hooks)
        self._restorer = ManagerRestorer(s, self._best)
        self._restorer.memory = getattr(writer, "mem", None) if scope.collective else None
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._save_cost: float | None = None
        self._pending_decision: tuple[tuple[int, int | None], SaveDecision | None] | None = None
        self._heartbeat_error: BaseException | None = None
        if prometheus:
            from .metrics import PrometheusMetrics

            s.metrics = PrometheusMetrics(self.run, None if prometheus is True else prometheus)
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

    @property
    def keep_policy(self) -> KeepPolicy | None:
        """The keep policy applied after every save (may be replaced between saves)."""
        return self._retention.keep

    @keep_policy.setter
    def keep_policy(self, keep: KeepPolicy | None) -> None:
        self._retention.keep = keep

    @property
    def total_steps(self) -> int | None:
        """Total steps of the run (lets ``LastStep()`` fire); a trainer may set it once it
        knows (after a resume, say)."""
        return self.options.total_steps

    @total_steps.setter
    def total_steps(self, total: int | None) -> None:
        self.options = dataclasses.replace(self.options, total_steps=total)  # validated
        self._session.options = self.options

    # Read-only views of the options (kept as attributes for callers and the integrations).
    async_save = property(lambda self: self.options.async_save)
    if_busy = property(lambda self: self.options.if_busy)
    codec = property(lambda self: self.options.codec)
    gc_grace_seconds = property(lambda self: self.options.gc_grace_seconds)
    workers = property(lambda self: self.options.workers)
    on_save_error = property(lambda self: self.options.on_save_error)

    # ----------------------------------------------------------------------------- helpers
    def _heartbeat_loop(self, interval: float) -> None:
        lease = self._lease
        assert lease is not None  # the loop runs only for a lease holder
        while not self._stop.wait(interval):
            try:
                lease.renew()
            except LeaseLostError:
                return  # lease.lost is set: the next commit and the next call refuse
            except Exception as exc:  # the store out of reach: warned, tried again next beat
                # Safe to go on: if the lease goes stale meanwhile and another writer takes
                # the run over, the commit's fence (Lease.guard) refuses this writer's saves.
                self._heartbeat_error = exc

    def _check(self) -> None:
        """Raise a background failure (save, lost lease) on the training thread."""
        if self._closed:
            raise StepvaultError(f"CheckpointManager for run {self.run!r} is closed")
        if self._lease is not None and self._lease.lost is not None:
            raise self._lease.lost  # on every call: this writer must stop
        if self._heartbeat_error is not None:
            exc, self._heartbeat_error = self._heartbeat_error, None
            warnings.warn(
                f"renewing the writer lease of run {self.run!r} failed ({exc}); retrying. If "
                "it keeps failing the lease goes stale and another writer may take the run "
                "over: this one's saves are then refused",
                RuntimeWarning,
                stacklevel=3,
            )
        bg = self._pipeline.bg
        if bg is not None:
            failed = bg.poll_error()
            if failed is not None:
                self._session.raise_or_warn(failed)

    def _context(self, step: int, epoch: int | None) -> SaveContext:
        return SaveContext(
            step=step,
            epoch=epoch,
            now=time.monotonic(),
            last_save_step=self._last_save_step,
            last_save_time=self._last_save_time,
            save_cost=self._save_cost,
            total_steps=self.options.total_steps,
        )

    def _decide(self, step: int, epoch: int | None) -> SaveDecision | None:
        # should_save() then save() at one boundary ask once (and, under a process group,
        # gather once); a call with another epoch at the same step is a new question.
        if self._pending_decision is not None and self._pending_decision[0] == (step, epoch):
            return self._pending_decision[1]
        decision = self.save_policy.decide(self._context(step, epoch))
        if decision is not None and not decision.urgent and step == self._last_save_step:
            decision = None  # already saved (or just restored) at this step
        decision = self._session.scope.agree(decision)
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
        .encode()}`` (see :mod:`stepvault.catalog.attachments`).

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
            self._prepare_soon(state)
            return None
        ctx = self._context(step, epoch)
        handle = self._pipeline.run(
            step,
            state,
            decision,
            epoch=epoch,
            metrics=metrics,
            metadata=metadata,
            attachments=attachments,
        )
        if handle is None:
            return None
        self._last_save_step = step
        self._last_save_time = ctx.now
        self.save_policy.saved(ctx, decision)
        self._save_cost = handle.stall_seconds  # what training pays per save (Young/Daly's C)
        if decision.exit_code is not None:
            self._session.event(
                "exit_after_save", step=step, exit_code=decision.exit_code, reason=decision.reason
            )
            self.close()
            raise SystemExit(decision.exit_code)
        return handle

    def prepare(
        self, state: Mapping[str, Any], *, wait: bool = False, partial: bool = False
    ) -> None:
        """Get the staging buffers for ``state`` ready before the first due save.

        Allocating host buffers and faulting in their pages costs more than a synchronous
        save; this starts it on a background thread and returns at once (``wait=True``
        blocks until the buffers are ready). It calls ``state_dict()`` of every object
        in ``state``, as a save does. ``restore()`` and a ``save()`` call that is not due
        prepare by themselves, reading only modules, optimizers and tensors (a user
        object's ``state_dict()`` may have effects; 1 MiB is left for the rest). Without
        ``async_save``, or for a multi-rank (DCP) manager, it does nothing.

        ``partial=True``: ``state`` is only the bulk of what the saves will hold (a
        framework integration passes the modules and optimizers); 1 MiB is left for the
        rest, as for an implicit preparation.
        """
        self._prepare(state, implicit=False, wait=wait, partial=partial)

    def _prepare(
        self,
        state: Mapping[str, Any],
        *,
        implicit: bool,
        wait: bool = False,
        partial: bool = False,
    ) -> None:
        self._check()
        if self._pipeline.bg is None or not isinstance(self._pipeline.writer, LocalWriter):
            return
        from ..state.snapshot import take_snapshot

        reserve = RESERVE if partial else 0
        # Prepared from a state that will still grow (a fresh optimizer): prepare again at
        # a later non-due save, or the first due save would find the buffers too small.
        self._prepared_final = not still_growing(state)
        if implicit:  # only what a snapshot reads without effects (see .preparing)
            state, reserve = readable_part(state)
        # The snapshot (state_dict() calls) runs here, on the caller's thread, where the
        # state may be read; only the allocation and page faults run in the background.
        self._staging.prepare(take_snapshot(state, kind="full").arrays, reserve=reserve)
        if wait:
            self._staging.wait_prepared()

    def _prepare_soon(self, state: Mapping[str, Any]) -> None:
        # Until buffers are ready (and not while a preparation runs): a non-due save()
        # or a restore() is the manager's first sight of the state. Once the state has
        # its final shape (an optimizer's moments appear at its first step), once more,
        # even while an earlier preparation runs: the pool queues it behind that one.
        first = not self._staging.ready and not self._staging.preparing
        again = (
            (self._staging.ready or self._staging.preparing)
            and not self._prepared_final
            and not still_growing(state)
        )
        if first or again:
            try:
                self._prepare(state, implicit=True)
            except (TypeError, ValueError):
                pass  # a state that cannot be saved fails at its due save, with the message

    def wait(self) -> SaveInfo | None:
        """Block until the save in flight (if any) is committed; raises its error
        (warns instead with ``on_save_error="warn"``)."""
        return self._pipeline.wait()

    # ---------------------------------------------------------------------- retention
    def retention_plan(self) -> RetentionPlan:
        """What the keep policy would delete now, and which rule keeps each survivor."""
        return self._retention.plan()

    def pin(self, step: int, note: str = "") -> None:
        """Protect ``step`` from every keep policy until :meth:`unpin`."""
        self.store.pin(self.run, step, note)
        self._session.event("pin", step=step, note=note)

    def unpin(self, step: int) -> None:
        self.store.unpin(self.run, step)
        self._session.event("unpin", step=step)

    # -------------------------------------------------------------------------- restore
    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | Literal["latest", "best"] = "latest",
        *,
        strict: bool = True,
        assign: bool = False,
        progress: Any = None,
    ) -> RestoreInfo | None:
        """Load a checkpoint into ``state``; None when the run has none (a fresh start).

        ``"latest"``: the newest full checkpoint that verifies, falling back past damaged
        ones (each reported in ``info.skipped``). ``"best"``: the best by the manager's
        metric, falling back to the next best. An int: exactly that step, no fallback.
        ``assign``: as in :func:`stepvault.restore` (modules take the mapped tensors).
        ``progress``: as in :func:`stepvault.restore` (by default a bar on a terminal when
        the checkpoint is read from a remote tier).
        """
        self._check()
        self.wait()
        self._restorer.progress = progress
        info = self._restorer.restore(state, step, strict=strict, assign=assign)
        if info is not None:
            self._last_save_step = info.step
        self._prepare_soon(state)  # the state as training will save it (optimizer loaded)
        return info

    @property
    def mem_hooks(self) -> list[Any]:
        """``hook(MemCommit)`` called after each commit into the mem tier (empty list and
        never called without one); see :mod:`stepvault.manager.mem_saving`."""
        return self._mem_saver.hooks if self._mem_saver is not None else []

    def add_restore_source(self, name: str, store: Store, *, before: str = "hot") -> None:
        """Restore also from ``store`` (e.g. a peer node's memory), tried just before tier
        ``before``; everything read from it is hash-verified like any tier."""
        from ..tiers.view import TieredView

        s = self._session
        if not isinstance(s.view, TieredView):
            from ..tiers.config import Tiers

            s.view = TieredView(Tiers(self.store, []))
            self._restorer.session = s
        s.view.add_source(name, store, before=before)
        s.view_records.clear()

    # ----------------------------------------------------------------------- queries
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every committed checkpoint of the run, oldest first."""
        return Vault(self.store).checkpoints(self.run)

    @property
    def latest_step(self) -> int | None:
        """The step a plain ``restore("latest")`` starts from: the newest full checkpoint in any
        tier, or None (a step only in the mem tier or only in a cold tier counts).
        ``"latest"`` means the same everywhere (:mod:`stepvault.catalog.refs`)."""
        return newest_full_step(self._session.view, self.run)

    @property
    def best_step(self) -> int | None:
        """Best step by the manager's metric, or None (no metric or no scored checkpoint)."""
        if not self._best:
            return None
        chosen = choose_candidates(self._session.records(), "best", best=self._best[0])
        return chosen.steps[0] if chosen.steps else None

    def events(self) -> list[dict[str, Any]]:
        """The run's event log."""
        return read_events(self.store, self.run)

    def stats(self) -> dict[str, Any]:
        """Summary: saves, failures, stalls, bytes, restores and their success rate."""
        return self._session.stats.summary(
            self._staging.nbytes,
            ready=self._staging.ready,
            budget=self._staging.budget,
            peak=self._staging.peak_bytes,
        )

    # ------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Wait for the save in flight, release the lease and signal handlers.

        Raises the in-flight save's error, if it failed (after cleaning up).
        """
        if self._closed:
            return
        error: BaseException | None = None
        try:
            error = self._pipeline.close()
            if self.tier_mover is not None:
                self.tier_mover.close()  # a last pass, while this process holds the lease
                if self.keep_policy is not None and self._session.scope.coordinator:
                    try:  # deletions deferred until the mover had copied those checkpoints
                        self._retention.apply()
                    except (StepvaultError, OSError):
                        pass  # the next session's first save applies it
            rank_mem = self._restorer.memory
            if rank_mem is not None:  # collective: removed once the newest is on disk
                rank_mem.close()
            if self._mem_saver is not None and self._session.scope.coordinator:
                self._mem_saver.close()  # newest mem copy to disk, then the tier removed
            if self._sweeper is not None:
                self._sweeper.close()  # every save is done: sweep what retention deleted
        finally:
            self._closed = True
            self._stop.set()
            if self._sweeper is not None:
                self._sweeper.close(final=False)  # the thread stops also when close failed
            self.save_policy.uninstall()
            self._pipeline.writer.close()
            self._staging.close()
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
