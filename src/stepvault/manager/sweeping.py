"""GC off the commit path: retention deletes manifests, a background thread sweeps objects.

Retention after a commit deletes manifests only (restic's ``forget``): cheap, one delete
each, and the checkpoint vanishes atomically. The sweep (restic's ``prune``: mark every
object a manifest of any run names, delete the rest past the grace period) costs a pass
over the whole store; run after every save it made a ``KeepLast(2)`` save into a store
holding 100 checkpoints of other runs read 102 manifests, on S3 a GET each. So the
:class:`Sweeper` runs it on its own thread, once enough deletions are pending
(``GCOptions.sweep_after_deletions``, default 8) or the oldest pending one is
``GCOptions.sweep_after_seconds`` old (default 60 s), and once more at ``close()``.
``stepvault gc`` sweeps on demand, as before.

Safety is the sweep's own (``engine/gc.py``): objects younger than the grace period are
never removed (a save in flight writes new objects and touches reused ones), and the
sweep stops at a manifest it cannot read. While this process may be saving, the grace
period is at least :data:`~stepvault.tiers.mover.CONCURRENT_GRACE_FLOOR`; the sweep at
``close()``, with every save finished, uses the manager's ``GCOptions.grace_seconds`` as is.
"""

from __future__ import annotations

import threading
import time

from ..engine.gc import SweepReport, sweep
from ..errors import StepvaultError
from ..tiers.mover import CONCURRENT_GRACE_FLOOR
from .options import GCOptions
from .session import RunSession


class Sweeper:
    """Sweeps the store's unreferenced objects on a background thread (coordinator only).

    :meth:`deleted` (from the retention hook, on the writer thread) only counts and wakes
    the thread; training and the writer never wait for a sweep. Failures are logged
    (``gc_failed``) and retried with the next deletion.
    """

    def __init__(self, session: RunSession, options: GCOptions | None = None) -> None:
        options = options or GCOptions()
        self.session = session
        self.after_deletions = options.sweep_after_deletions
        self.after_seconds = options.sweep_after_seconds
        self._cond = threading.Condition()
        self._pending = 0
        self._since: float | None = None  # monotonic time of the oldest pending deletion
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._sweeping = threading.Lock()  # one sweep at a time (thread or close)
        #: a background sweep kept objects that the manager's own, shorter grace period
        #: would free: the sweep at close() frees them
        self._held_by_floor = False
        #: reports of the sweeps run so far (the newest last)
        self.reports: list[SweepReport] = []
        self.last_error: BaseException | None = None

    @property
    def pending(self) -> int:
        """Checkpoints deleted since the last sweep started."""
        return self._pending

    def deleted(self, count: int) -> None:
        """``count`` manifests were deleted: their objects are swept soon."""
        if count <= 0:
            return
        with self._cond:
            self._pending += count
            if self._since is None:
                self._since = time.monotonic()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="stepvault-sweep"
                )
                self._thread.start()
            self._cond.notify_all()

    def _due(self) -> float | None:
        """Seconds until a sweep is due (0: now), None when nothing is pending."""
        if self._pending == 0 or self._since is None:
            return None
        if self._pending >= self.after_deletions:
            return 0.0
        return max(0.0, self._since + self.after_seconds - time.monotonic())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._due() != 0.0:
                    self._cond.wait(self._due())
                if self._stopping:
                    return
                self._pending, self._since = 0, None
            own = self.session.options.gc_grace_seconds
            report = self._sweep(max(own, CONCURRENT_GRACE_FLOOR))
            if report is not None and report.kept_in_grace and own < CONCURRENT_GRACE_FLOOR:
                self._held_by_floor = True

    def _sweep(self, grace: float) -> SweepReport | None:
        s = self.session
        with self._sweeping:
            try:
                report = sweep(s.store, grace_seconds=grace)
            except (StepvaultError, OSError) as exc:
                self.last_error = exc
                s.event("gc_failed", error=f"{type(exc).__name__}: {exc}")
                return None
            self.last_error = None
            self.reports = [*self.reports[-9:], report]
            with s.stats.lock:
                s.stats.freed_bytes += report.freed_bytes
            fields: dict[str, object] = {}
            if report.unreadable_manifests:  # the sweep stopped: say which, never guess
                fields["unreadable_manifests"] = report.unreadable_manifests[:10]
            s.event(
                "gc",
                deleted_objects=len(report.deleted),
                freed_bytes=report.freed_bytes,
                kept_in_grace=report.kept_in_grace,
                **fields,
            )
            return report

    def close(self, *, final: bool = True) -> None:
        """Stop the thread (a sweep in progress finishes); with ``final`` and deletions
        pending, sweep once more now with the manager's own grace period (no save of this
        manager is in flight any more)."""
        with self._cond:
            self._stopping = True
            pending = self._pending
            self._pending, self._since = 0, None
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        if final and (pending or self._held_by_floor):
            self._sweep(self.session.options.gc_grace_seconds)
