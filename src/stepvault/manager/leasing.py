"""The manager's hold on its run's writer lease: a heartbeat thread, and the check that
stops a writer whose lease was lost (ARCHITECTURE.md invariant 6).

The lease itself (a compare-and-set record with a fencing token, checked by every commit
of the run) is :mod:`stepvault.store.lease`; this module only keeps it alive and reports
on the training thread what the heartbeat found. At each beat it also removes the manifests
that landed after this holder's takeover (an earlier holder's commit in flight through a
partition: readers already ignore them, FORMAT.md §8) and logs each as a
``stale_commit_removed`` event.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

from ..errors import LeaseLostError
from ..store.lease import Lease


class LeaseKeeper:
    """Renews ``lease`` every ``interval`` seconds on its own thread (None: a rank that
    holds no lease; every method is then a no-op)."""

    def __init__(
        self,
        lease: Lease | None,
        run: str,
        interval: float,
        event: Callable[..., None] | None = None,
    ) -> None:
        self.lease = lease
        self.run = run
        self.interval = interval
        #: where ``stale_commit_removed`` events go (the run's event log)
        self.event = event
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.lease is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stepvault-lease")
        self._thread.start()

    def _loop(self) -> None:
        lease = self.lease
        assert lease is not None  # started only for a lease holder
        while not self._stop.wait(self.interval):
            try:
                lease.renew()
                self.remove_stale_commits()
            except LeaseLostError:
                return  # lease.lost is set: the next commit and the next call refuse
            except Exception as exc:  # the store out of reach: warned, tried again next beat
                # Safe to go on: if the lease goes stale meanwhile and another writer takes
                # the run over, the commit's fence (Lease.guard) refuses this writer's saves.
                self._error = exc

    def remove_stale_commits(self) -> list[tuple[int, str]]:
        """Delete the run's manifests that landed after a takeover (under this lease's
        fence) and log each, with those a commit of this writer removed meanwhile."""
        if self.lease is None:
            return []
        store = self.lease.store
        store.remove_stale_commits(self.run)
        removed, store.stale_removed[:] = list(store.stale_removed), []
        out = []
        for _, step, reason in removed:
            out.append((step, reason))
            if self.event is not None:
                try:
                    self.event("stale_commit_removed", step=step, reason=reason)
                except Exception:  # the log out of reach: the removal itself stands
                    pass
        return out

    def check(self) -> None:
        """On the training thread: raise a lost lease (on every call: this writer must
        stop); warn once per failed renewal."""
        if self.lease is not None and self.lease.lost is not None:
            raise self.lease.lost
        if self._error is not None:
            exc, self._error = self._error, None
            warnings.warn(
                f"renewing the writer lease of run {self.run!r} failed ({exc}); retrying. If "
                "it keeps failing the lease goes stale and another writer may take the run "
                "over: this one's saves are then refused",
                RuntimeWarning,
                stacklevel=4,
            )

    def stop(self) -> None:
        """Stop renewing (the lease stays held until :meth:`release`)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def release(self) -> None:
        """Stop renewing and give the run free (never raises for an unreachable store)."""
        self.stop()
        if self.lease is not None:
            try:
                self.lease.release()
            except OSError:
                pass
