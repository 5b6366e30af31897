"""The background half of an asynchronous save: one worker thread, errors kept for later.

The training thread hands over a job (hash → encode → write → commit, then retention)
and returns; the job runs here. An exception is stored and raised on the training thread
at its next call into the manager, in ``wait()`` and in ``close()`` — never swallowed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    """Runs at most one job at a time on a dedicated thread."""

    def __init__(self, name: str = "stepvault-writer") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._future: Future | None = None

    @property
    def busy(self) -> bool:
        """True while a job is running."""
        return self._future is not None and not self._future.done()

    def submit(self, job: Callable[[], Any]) -> Future:
        """Start ``job``; the previous one must be finished (call :meth:`wait` first)."""
        if self.busy:
            raise RuntimeError("a background save is still in flight")
        self._future = self._pool.submit(job)
        return self._future

    def wait(self) -> Any:
        """Block until the current job is done; re-raise its exception, if any (once)."""
        future, self._future = self._future, None
        if future is None:
            return None
        return future.result()

    def poll_error(self) -> BaseException | None:
        """The finished job's exception (clearing it), without blocking."""
        if self._future is not None and self._future.done():
            exc = self._future.exception()
            if exc is not None:
                self._future = None
                return exc
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
