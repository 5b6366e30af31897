"""``CheckpointManager``: the one object a training loop talks to.

It decides *when* to save (the save policy, agreed across ranks under a process group)
and hands everything else to its pipeline (:mod:`.pipeline`), built once at construction:
the save pipeline (only the copy into reusable host buffers happens on the training
thread), the after-commit hooks (retention, the tier mover), GC off the commit path, the
restore planner and the lease. What differs between one process and every rank of a
process group is one strategy object chosen at construction (:mod:`.scope`).

(Its length is the public class, its documented parameters and the save decision; the
work is in the modules named above.)
"""

from __future__ import annotations

import dataclasses
import os
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
from ..errors import CheckpointNotFoundError, NoValidCheckpointError, StepvaultError
from ..policy import KeepPolicy, RetentionPlan, SaveContext, SaveDecision, SavePolicy
from ..store import Store, validate_run_name, validate_step
from ..store.signing import Signer
from ..tiers.mem import MemTier
from ..tiers.mover import TierMover
from . import at_exit
from .options import ManagerOptions, RunSettings
from .pipeline import build_pipeline
from .preparing import Preparer
from .saving import LocalWriter, SaveRequest
from .stats import SaveHandle


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
        keep: keep policy applied after every save (default: keep everything). It deletes
            manifests; their objects are swept off the commit path (``GCOptions``).
        tiers: more places to keep checkpoints, name -> where. Cold tiers: a URL/path
            (``{"archive": "s3://bucket/ckpts"}``), recorded in the store so restores and
            the CLI find them (default: those recorded). ``"mem"``: node shared memory,
            written first and read first (``True``, a tmpfs path, or a
            :class:`~stepvault.manager.options.MemOptions` with its budget, cleanup and
            replication to a buddy node). See STORAGE.md.
        tier_policy: where checkpoints live, e.g. ``HotLast(3) | CopyEvery("archive",
            steps=5)``; a background mover applies it after each commit (training never
            waits; ``close()`` lets it finish). Restores read from any tier, memory and hot
            first.
        async_save: write in a background thread; training waits only for the copy of
            tensors into reusable host buffers. The buffers are allocated and pre-faulted
            in the background as soon as the manager sees the state (``restore()``, a
            ``save()`` call that is not due, or :meth:`prepare`); a save due before they
            are ready is written synchronously (it stalls as long as a synchronous save).
            Their budget and what a busy writer does: ``ManagerOptions.staging``.
        codec: chunk codec for this run's saves (default: the store's setting).
        total_steps: lets ``LastStep()`` fire.
        best_metric, best_mode: what "best" means for ``restore(step="best")`` and
            ``best_step`` (default: the metric of the first KeepBest in ``keep``).
        collective: None (default) makes the manager collective under a process group
            of more than one rank (every rank calls ``save``). ``False`` makes it
            rank-local: for trainers that save a replicated (DDP) model from rank 0 only
            (Lightning, the HF Trainer); sharded DTensor state is then refused. ``True``
            makes it collective under any process group, one rank included (an FSDP2
            job on one process).
        lineage: a :class:`~stepvault.registry.Lineage` (``Lineage.capture(config, data=...,
            parent="base@1000")``) linked from every manifest; by default the git commit and
            environment are captured; ``False`` records nothing.
        signer: a :class:`~stepvault.signing.Signer` that signs every manifest (default:
            ``$STEPVAULT_SIGNING_KEY`` when set).
        prometheus: True (default registry) or a ``CollectorRegistry`` to export metrics.
        options: everything else, typed and nested
            (:class:`~stepvault.manager.options.ManagerOptions`): ``staging`` (host memory
            for async saves, ``if_busy``), ``gc`` (grace period, when to sweep), ``lease``
            (when a silent writer's run may be taken over), ``workers``, ``on_save_error``
            (``"warn"``: a failed save warns and training goes on), ``light`` (how light
            saves encode), ``resume_from_light``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Store,
        run: str,
        *,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        tiers: Mapping[str, Any] | None = None,
        tier_policy: Any = None,
        async_save: bool = True,
        codec: str | None = None,
        total_steps: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        collective: bool | None = None,
        lineage: Lineage | Literal[False] | None = None,
        signer: Signer | None = None,
        prometheus: Any = False,
        options: ManagerOptions | None = None,
    ) -> None:
        # Every option is checked here, before the store is touched.
        self._settings = RunSettings(
            options if options is not None else ManagerOptions(),
            async_save=async_save,
            codec=codec,
            total_steps=total_steps,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self.run = validate_run_name(run)
        self.save_policy: SavePolicy = save if save is not None else _SaveAlways()
        # Lineage (config, git commit, data, environment, parent) is captured once per
        # session and linked from every manifest it commits; lineage=False records none.
        self.lineage: Lineage | None = Lineage.capture() if lineage is None else (lineage or None)
        self._p = build_pipeline(
            root,
            self.run,
            self._settings,
            policy=self.save_policy,
            keep=keep,
            tiers=tiers,
            tier_policy=tier_policy,
            collective=collective,
            lineage=self.lineage,
            signer=signer,
            prometheus=prometheus,
        )
        self.store: Store = self._p.session.store
        self._preparer = Preparer(
            self._p.staging,
            enabled=async_save and isinstance(self._p.saves.writer, LocalWriter),
        )
        self._closed = False
        if isinstance(self._p.saves.writer, LocalWriter):
            at_exit.track(self)  # a script that never closes still commits its last save
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._save_cost: float | None = None
        self._pending_decision: tuple[tuple[int, int | None], SaveDecision | None] | None = None

    # ----------------------------------------------------------------------- settings
    @property
    def options(self) -> ManagerOptions:
        """The manager's :class:`~stepvault.manager.options.ManagerOptions`."""
        return self._settings.options

    @property
    def async_save(self) -> bool:
        return self._settings.async_save

    @property
    def codec(self) -> str | None:
        return self._settings.codec

    @property
    def keep_policy(self) -> KeepPolicy | None:
        """The keep policy applied after every save (may be replaced between saves)."""
        return self._p.retention.keep

    @keep_policy.setter
    def keep_policy(self, keep: KeepPolicy | None) -> None:
        self._p.retention.keep = keep

    @property
    def total_steps(self) -> int | None:
        """Total steps of the run (lets ``LastStep()`` fire); a trainer may set it once it
        knows (after a resume, say)."""
        return self._settings.total_steps

    @total_steps.setter
    def total_steps(self, total: int | None) -> None:
        self._settings = dataclasses.replace(self._settings, total_steps=total)  # validated
        self._p.session.options = self._settings

    @property
    def mem_tier(self) -> MemTier | None:
        """The mem tier (node shared memory), or None."""
        return self._p.mem_tier

    @property
    def tier_mover(self) -> TierMover | None:
        """The background mover of the tier policy (the coordinator's), or None."""
        return self._p.mover

    # ----------------------------------------------------------------------------- helpers
    def _check(self) -> None:
        """Raise a background failure (save, lost lease) on the training thread."""
        if self._closed:
            raise StepvaultError(f"CheckpointManager for run {self.run!r} is closed")
        self._p.lease.check()
        bg = self._p.saves.bg
        if bg is not None:
            failed = bg.poll_error()
            if failed is not None:
                self._p.session.raise_or_warn(failed)

    def _context(self, step: int, epoch: int | None) -> SaveContext:
        return SaveContext(
            step=step,
            epoch=epoch,
            now=time.monotonic(),
            last_save_step=self._last_save_step,
            last_save_time=self._last_save_time,
            save_cost=self._save_cost,
            total_steps=self._settings.total_steps,
        )

    def _decide(self, step: int, epoch: int | None) -> SaveDecision | None:
        # should_save() then save() at one boundary ask once (and, under a process group,
        # gather once); a call with another epoch at the same step is a new question.
        if self._pending_decision is not None and self._pending_decision[0] == (step, epoch):
            return self._pending_decision[1]
        decision = self.save_policy.decide(self._context(step, epoch))
        if decision is not None and not decision.urgent and step == self._last_save_step:
            decision = None  # already saved (or just restored) at this step
        try:
            decision = self._p.session.scope.agree(decision)
        except RuntimeError as exc:  # gloo: another rank closed its connections (it stopped)
            raise self._p.session.peer_stopped(step, exc) from exc
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
            self._preparer.soon(state)
            return None
        ctx = self._context(step, epoch)
        handle = self._p.saves.run(
            SaveRequest(step, state, decision, epoch, metrics, metadata, attachments)
        )
        if handle is None:
            return None
        self._last_save_step = step
        self._last_save_time = ctx.now
        self.save_policy.saved(ctx, decision)
        self._save_cost = handle.stall_seconds  # what training pays per save (Young/Daly's C)
        if decision.exit_code is not None:
            self._p.session.event(
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
        self._check()
        self._preparer.prepare(state, implicit=False, wait=wait, partial=partial)

    def wait(self, *, replicated: bool = False) -> SaveInfo | None:
        """Block until the save in flight (if any) is committed; raises its error
        (warns instead with ``on_save_error="warn"``).

        ``replicated=True`` (collective, with ``MemOptions(replicate=True)``): also wait
        until every queued replica is written to (or refused by) the buddy node, then
        gather every rank's replica state into ``stats()["replication"]["ranks"]``; a rank
        whose newest memory checkpoint is not replicated (no buddy, a replica skipped or
        failed) is named, with the reason, in a RuntimeWarning."""
        info = self._p.saves.wait()
        if replicated and self._p.rank_mem is not None:
            ranks = self._p.rank_mem.wait_replicated()
            bad = [r for r in ranks if r.get("state") not in ("replicated", "none")]
            if bad:
                warnings.warn(
                    "stepvault: not replicated: "
                    + "; ".join(f"rank {r['rank']}: {r['state']} ({r.get('reason')})" for r in bad),
                    RuntimeWarning,
                    stacklevel=2,
                )
        return info

    # ---------------------------------------------------------------------- retention
    def retention_plan(self) -> RetentionPlan:
        """What the keep policy would delete now, and which rule keeps each survivor."""
        return self._p.retention.plan()

    def pin(self, step: int, note: str = "") -> None:
        """Protect ``step`` from every keep policy until :meth:`unpin`; a step whose
        asynchronous save is still in flight is pinned once it is committed."""
        try:
            self.store.pin(self.run, step, note)
        except CheckpointNotFoundError:
            bg = self._p.saves.bg
            if bg is None or not bg.busy:
                raise
            self.wait()  # e.g. pin(step) right after save(step)
            self.store.pin(self.run, step, note)
        self._p.session.event("pin", step=step, note=note)

    def unpin(self, step: int) -> None:
        self.store.unpin(self.run, step)
        self._p.session.event("unpin", step=step)

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
        info = self._p.restorer.restore(
            state, step, strict=strict, assign=assign, progress=progress
        )
        if info is not None:
            self._last_save_step = info.step
        self._preparer.soon(state)  # the state as training will save it (optimizer loaded)
        return info

    # ----------------------------------------------------------------------- queries
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every committed checkpoint of the run, oldest first."""
        return Vault(self.store).checkpoints(self.run)

    @property
    def latest_step(self) -> int | None:
        """The step a plain ``restore("latest")`` starts from: the newest full checkpoint in any
        tier, or None (a step only in the mem tier or only in a cold tier counts).
        ``"latest"`` means the same everywhere (:mod:`stepvault.catalog.refs`)."""
        return newest_full_step(self._p.session.view, self.run)

    @property
    def best_step(self) -> int | None:
        """Best step by the manager's metric, or None (no metric or no scored checkpoint)."""
        if not self._p.best:
            return None
        chosen = choose_candidates(self._p.session.records(), "best", best=self._p.best[0])
        return chosen.steps[0] if chosen.steps else None

    def events(self) -> list[dict[str, Any]]:
        """The run's event log."""
        return read_events(self.store, self.run)

    def stats(self) -> dict[str, Any]:
        """Summary: saves, failures, stalls, bytes, restores and their success rate."""
        staging = self._p.staging
        out = self._p.session.stats.summary(
            staging.nbytes, ready=staging.ready, budget=staging.budget, peak=staging.peak_bytes
        )
        if self._p.rank_mem is not None:  # MemOptions(replicate=True): replica state
            out["replication"] = self._p.rank_mem.stats()
        return out

    # ------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Wait for the save in flight, release the lease and signal handlers.

        Raises the in-flight save's error, if it failed (after cleaning up).
        """
        if self._closed:
            return
        self._closed = True
        at_exit.forget(self)
        error = self._p.close()  # the shutdown order is the pipeline's
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
