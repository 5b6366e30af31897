"""The background half of an asynchronous save: one worker thread, errors kept for later.

The training thread hands over a job (hash → encode → write → commit, then retention)
and returns; the job runs here. Up to ``max_jobs`` jobs may be in flight (each with its
own staged copy); they run one after another, in the order submitted, so commits keep
step order. An exception is stored and raised on the training thread
at its next call into the manager, in ``wait()`` and in ``close()`` — never swallowed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWriter:
    """Runs jobs one at a time on a dedicated thread; at most ``max_jobs`` in flight."""

    def __init__(self, name: str = "stepvault-writer", max_jobs: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._futures: deque[Future] = deque()
        self.max_jobs = max_jobs

    def _drop_done(self) -> None:
        # Finished jobs without an error need no one to wait for them any more.
        while self._futures and self._futures[0].done() and not self._futures[0].exception():
            self._futures.popleft()

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not finished."""
        return sum(not f.done() for f in self._futures)

    @property
    def busy(self) -> bool:
        """True while a job is running or queued."""
        return self.in_flight > 0

    @property
    def full(self) -> bool:
        """True when ``max_jobs`` jobs are in flight (a new one must wait or be skipped)."""
        return self.in_flight >= self.max_jobs

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job``; fewer than ``max_jobs`` may be in flight (see :meth:`wait_one`)."""
        if self.full:
            raise RuntimeError("as many background saves as allowed are still in flight")
        self._drop_done()
        future = self._pool.submit(job)
        self._futures.append(future)
        return future

    def wait_one(self) -> Any:
        """Block until the oldest job is done; re-raise its exception, if any (once)."""
        if not self._futures:
            return None
        return self._futures.popleft().result()

    def wait(self) -> Any:
        """Block until every job is done; returns the last one's result and re-raises
        the first exception (each once; the later jobs still ran)."""
        result = None
        while self._futures:
            result = self.wait_one()
        return result

    def poll_error(self) -> BaseException | None:
        """A finished job's exception (clearing it), without blocking."""
        self._drop_done()
        for future in list(self._futures):
            if future.done() and future.exception() is not None:
                self._futures.remove(future)
                return future.exception()
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
