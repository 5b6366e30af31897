"""The manager's save pipeline: admit → stage → hand off → commit → after-commit hooks.

Only *stage* runs on the training thread (the snapshot and the copy into reused host
buffers); the writer thread runs *commit* (hash, encode, write, commit the manifest) and
then the hooks (retention, the tier mover). Two writers implement *stage*/*commit* over
their destinations: :class:`LocalWriter` (this process writes the whole state: node memory
first when there is a mem tier, then the store, one set of chunk digests for both) and
``CollectiveWriter`` (:mod:`.collective_saving`: every rank writes its shards through DCP;
rank 0 commits).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ..catalog.attachments import add_attachments
from ..core.info import SaveInfo
from ..core.light import light_arrays, light_host
from ..core.write import new_manifest, write_manifest
from ..engine import to_host
from ..engine.background import BackgroundWriter
from ..engine.staging import HostArray, from_bytes
from ..engine.staging_pool import StagingPool
from ..engine.writer import ChunkDigests
from ..format import Manifest
from ..policy import SaveDecision
from ..state.snapshot import Snapshot, take_snapshot
from .session import RunSession
from .stats import SaveHandle

if TYPE_CHECKING:
    from .collective_saving import CollectiveWriter
    from .mem_saving import MemSaver

#: Work after a save is committed, on the writer thread: ``hook(info)``.
AfterCommit = Callable[[SaveInfo], None]


@dataclass(frozen=True)
class SaveRequest:
    """One due save, as the manager hands it to the pipeline: what every destination
    writes (ARCHITECTURE.md, "The save path")."""

    step: int
    state: Mapping[str, Any]
    decision: SaveDecision
    epoch: int | None = None
    metrics: Mapping[str, Any] | None = None
    metadata: Any = None
    #: small files stored with the checkpoint (file name -> bytes or a path), read at stage
    attachments: Mapping[str, Any] | None = None


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The finite numbers of ``metrics`` as floats (0-d tensors and numpy scalars too)."""
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[str(name)] = number
    return out


@dataclass
class Staged:
    """A save past its training-thread part: the stall it cost and the rest to run."""

    stall: float
    background: bool
    #: writes (or waits for) the objects and the commit; returns the info and the extra
    #: fields of its "save" event
    commit: Callable[[], tuple[SaveInfo, dict[str, Any]]]
    started: float = field(default_factory=time.perf_counter)
    #: what is being written when it differs from the decision (a light save without a
    #: base yet is written full)
    kind: str | None = None


class LocalWriter:
    """This process snapshots, stages and writes the whole state.

    An asynchronous save stages into an area of the pool only when one is ready
    (allocated and pre-faulted in the background); otherwise that save is written
    synchronously, which costs the stall of a synchronous save and no more (allocating
    on the training thread cost 2.3x it), while the pool prepares for the next one.
    """

    waits_for_previous = False  # a busy writer may be skipped (if_busy="skip")

    def __init__(
        self, session: RunSession, staging: StagingPool, *, mem: MemSaver | None = None
    ) -> None:
        self.session = session
        self.staging = staging
        self._parent: Manifest | None = None  # the last commit: its object table is reused
        self._warned_budget = False
        #: the mem tier's destination (.mem_saving): each save goes there first
        self.mem = mem

    def in_flight_limit(self) -> int:
        """Saves that may be in flight at once (the staging budget's slots, at least 1)."""
        return max(1, self.staging.slots())

    def _area(self, step: int, arrays: dict[str, Any]) -> Any:
        area = self.staging.acquire(arrays)
        if area is None and self.staging.slots() == 0 and not self._warned_budget:
            self._warned_budget = True
            budget = self.staging.budget
            warnings.warn(
                f"stepvault: the state needs more staging memory than StagingOptions(memory="
                f"{budget}) bytes allows, so every save of run {self.session.run!r} is "
                "written synchronously; raise ManagerOptions(staging=StagingOptions(memory=...)) "
                "to save asynchronously",
                RuntimeWarning,
                stacklevel=5,
            )
            self.session.event("staging_over_budget", step=step, budget=budget)
        return area

    def _light_from_staged(
        self, manifest: Manifest, snapshot: Snapshot, host: dict[str, HostArray]
    ) -> dict[str, HostArray]:
        """The arrays of a light save, built from its staged copy (writer thread)."""
        staged = {n: from_bytes(h.kind, h.dtype, h.shape, h.data) for n, h in host.items()}
        copy = Snapshot(snapshot.state, snapshot.kinds, staged)
        arrays = light_arrays(self.session.store, manifest, copy, self.session.options.light)
        # Exact entries stay views of the staging area, held until the write is done.
        return {n: to_host(v) for n, v in arrays.items()}

    def stage(self, request: SaveRequest, *, background: bool) -> Staged | None:
        """The training thread's part of ``request``; the rest is the returned commit."""
        s = self.session
        step, state, decision = request.step, request.state, request.decision
        epoch, metrics, metadata = request.epoch, request.metrics, request.metadata
        attachments = request.attachments
        t0 = time.perf_counter()
        try:
            s.scope.check_state(state)
            # a light save starts from the whole state (core.light picks what becomes deltas)
            full = "full" if decision.kind == "light" else decision.kind
            snapshot = take_snapshot(state, kind=full)
            manifest = new_manifest(
                s.run,
                step,
                snapshot,
                epoch=epoch,
                kind=decision.kind,
                metrics=metrics,
                metadata=metadata,
                lineage=s.lineage_ref(),
            )
            add_attachments(s.store, manifest, attachments)  # small files, written now
            light = None
            if decision.kind == "light" and not background:
                light = light_host(s.store, manifest, snapshot, s.options.light)
            background_wanted = background and light is None
            area = self._area(step, snapshot.arrays) if background_wanted else None
            # An asynchronous light save stages the whole state like a full one (the only
            # stall: a memory copy) and builds its deltas from that copy on the writer thread.
            light_later = area is not None and decision.kind == "light"
            if light is not None:
                host = light  # own copies: the write may still run in the background
            elif area is not None:
                try:
                    host = area.stage(snapshot.arrays)
                except BaseException:
                    self.staging.release(area)
                    raise
            elif decision.kind == "light" and (
                light := light_host(s.store, manifest, snapshot, s.options.light)
            ):  # no ready buffers: the deltas (own copies) now, the write in the background
                host = light
            else:
                if background:  # no ready buffers: this one save is synchronous
                    background = False
                    self.staging.pause()  # a pre-fault in flight yields the cores to it
                host = {name: to_host(value) for name, value in snapshot.arrays.items()}
        except BaseException as exc:
            self.staging.resume()
            s.failed(step, exc)
            raise

        def commit() -> tuple[SaveInfo, dict[str, Any]]:
            try:
                if area is not None:
                    area.wait_copied()  # device-to-host copies done (at once on CPU)
                out = self._light_from_staged(manifest, snapshot, host) if light_later else host
                mem_info: SaveInfo | None = None
                fields: dict[str, Any] = {}
                # One set of chunk digests for both destinations: memory, then disk, write
                # the same buffers (held until this commit is done), hashed once.
                digests = None
                if self.mem is not None:  # into node memory first (.mem_saving)
                    digests = ChunkDigests(out)
                    mem_info, fields = self.mem.save(
                        manifest, out, urgent=decision.urgent, digests=digests
                    )
                    fields["hashed_bytes"] = digests.hashed_bytes
                mem = self.mem
                if mem_info is not None and mem and not mem.wants_disk(step, decision.urgent):
                    rate = mem_info.throughput if math.isfinite(mem_info.throughput) else None
                    return mem_info, {**fields, "tier": "mem", "throughput_bytes_per_s": rate}
                info = write_manifest(
                    s.store,
                    manifest,
                    out,
                    codec=s.options.codec,
                    overwrite=True,
                    workers=s.options.workers,
                    parent=self._parent,
                    digests=digests,
                )
                if digests is not None:
                    fields["hashed_bytes"] = digests.hashed_bytes
                if mem_info is not None:
                    fields["tier"] = "mem+hot"
            except BaseException as exc:
                s.failed(step, exc)
                raise
            finally:
                if area is not None:
                    self.staging.release(area)
                elif background_wanted:
                    self.staging.resume()
                    # after the write, so that faulting in memory does not slow it down
                    self.staging.prepare(snapshot.arrays)
            self._parent = manifest
            rate = info.throughput if math.isfinite(info.throughput) else None
            return info, {**fields, "throughput_bytes_per_s": rate}

        return Staged(time.perf_counter() - t0, background, commit, started=t0, kind=manifest.kind)

    def close(self) -> None:
        self.staging.close()


#: A writer drives a save's destinations: :class:`LocalWriter` here, or
#: :class:`~stepvault.manager.collective_saving.CollectiveWriter` under a process group.
Writer = Union[LocalWriter, "CollectiveWriter"]


class SavePipeline:
    """Runs one due save through the writer and the background thread, then the hooks."""

    def __init__(
        self,
        session: RunSession,
        writer: Writer,
        background: BackgroundWriter | None,
        hooks: list[AfterCommit],
    ) -> None:
        self.session = session
        self.writer = writer
        self.bg = background
        self.hooks = hooks
        # The run's own retention settings, carried by every save event: the dashboard's
        # preview and "best" marks follow what the run was configured with.
        from .hooks import Retention  # (hooks imports the session, never this module)

        keep = next((h for h in hooks if isinstance(h, Retention)), None)
        self._policy_fields: dict[str, Any] = (
            {}
            if keep is None
            else {
                "keep": repr(keep.keep) if keep.keep is not None else None,
                "best": [[metric, mode] for metric, mode in keep.best],
            }
        )

    def wait(self) -> SaveInfo | None:
        """Block until the save in flight (if any) is committed; its error is raised (or
        warned, with ``on_save_error="warn"``)."""
        try:
            return self.bg.wait() if self.bg is not None else None
        except BaseException as exc:
            self.session.raise_or_warn(exc)
            return None

    def _admit(self, step: int, background: bool) -> bool:
        """Whether this save may start now (waiting for the one in flight if need be)."""
        if self.writer.waits_for_previous:
            self.wait()  # all ranks: the previous save is committed (or failed) first
            return True
        if self.bg is not None:
            self.bg.max_jobs = self.writer.in_flight_limit()
        if self.bg is not None and self.bg.full:
            if background and self.session.options.if_busy == "skip":
                with self.session.stats.lock:
                    self.session.stats.skipped_busy += 1
                self.session.event(
                    "save_skipped", step=step, reason="previous save still in flight"
                )
                return False
            try:
                self.bg.wait_one()  # the oldest; raises its error, if any
            except BaseException as exc:
                self.session.raise_or_warn(exc)
        return True

    def run(self, request: SaveRequest) -> SaveHandle | None:
        """Start the save ``request`` asks for; None when it was skipped or failed (and
        the failure only warned)."""
        step, decision = request.step, request.decision
        background = self.bg is not None and not decision.urgent
        if not self._admit(step, background):
            return None
        staged = self.writer.stage(request, background=background)
        if staged is None:
            return None
        kind = staged.kind or decision.kind
        handle = SaveHandle(step, kind, decision.reason, staged.stall, staged.background)

        def job() -> SaveInfo:
            info, fields = staged.commit()
            # the metrics outlive the checkpoint (retention): a run's curves are drawn
            # from its save events
            fields = {"metrics": _plain_metrics(request.metrics), **fields}
            self._committed(info, decision, staged, fields)
            return info

        if staged.background:
            assert self.bg is not None  # a background stage needs the writer thread
            handle._future = self.bg.submit(job)
            return handle
        try:
            handle._info = job()
        except BaseException as exc:
            self.session.raise_or_warn(exc)
            return None
        finally:
            self.session.scope.barrier()  # every rank sees the same store after the save
        # A synchronous save stalls training for all of it, write included.
        handle.stall_seconds = time.perf_counter() - staged.started
        with self.session.stats.lock:
            self.session.stats.stalls[-1] = handle.stall_seconds
        return handle

    def _committed(
        self, info: SaveInfo, decision: SaveDecision, staged: Staged, fields: dict[str, Any]
    ) -> None:
        """Bookkeeping after a commit (writer thread): counters, metrics, event, hooks."""
        s = self.session
        s.stats.saved(info, staged.stall)
        s.forget(info.step)  # re-read (with its manifest id) when needed
        if s.metrics:
            s.metrics.saved(
                info.kind, staged.stall, info.seconds, info.new_bytes, info.logical_bytes, info.step
            )
        s.event(
            "save",
            step=info.step,
            kind=info.kind,
            reason=decision.reason,
            asynchronous=staged.background,
            logical_bytes=info.logical_bytes,
            stored_bytes=info.stored_bytes,
            new_bytes=info.new_bytes,
            stall_seconds=staged.stall,
            write_seconds=info.seconds,
            **self._policy_fields,
            **fields,
        )
        for hook in self.hooks:
            hook(info)

    def close(self) -> BaseException | None:
        """Wait for the save in flight and stop the writer thread; the save's error."""
        error: BaseException | None = None
        if self.bg is not None:
            try:
                self.wait()
            except BaseException as exc:
                error = exc
            self.bg.shutdown()
        return error
