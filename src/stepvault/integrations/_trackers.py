"""What the experiment-tracker hooks share (MLflow, Weights & Biases, Ray Train).

A tracker hook is an after-commit hook (``ManagerOptions(hooks=[...])``) that tells a
tracker where a committed checkpoint is, never its bytes. Talking to a tracker is a
network call that may hang or fail, and training must never wait for it: the hook only
puts the step on a queue; one daemon thread per hook does the calls, retries with
backoff, and records the outcome in the run's event log (``tracker_ref`` on success,
``tracker_failed`` after the last try). ``mgr.close()`` waits for the queue a bounded
time (``close_timeout``), then records what is left as failed and returns.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..catalog import checkpoint_records
from ..catalog.refs import located_ref
from ..core.info import SaveInfo
from ..manager.hooks import HookContext
from ..store import Store


@dataclass(frozen=True)
class CommittedCheckpoint:
    """One committed checkpoint, as a tracker records it (read from its summary row)."""

    run: str
    step: int
    kind: str
    epoch: int | None
    #: the store's location (a path or a URL such as ``s3://bucket/ckpts``)
    root: str
    #: BLAKE3 of the manifest file: pins the exact checkpoint
    manifest_id: str
    logical_bytes: int
    stored_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """``RUN@STEP``."""
        return f"{self.run}@{self.step}"

    @property
    def uri(self) -> str:
        """``stepvault:ROOT#RUN@STEP``: what ``stepvault.restore`` takes back."""
        return located_ref(self.root, self.run, self.step)

    def tags(self) -> dict[str, str]:
        """The ``stepvault.*`` tags every tracker records (strings)."""
        return {
            "stepvault.uri": self.uri,
            "stepvault.root": self.root,
            "stepvault.ref": self.ref,
            "stepvault.run": self.run,
            "stepvault.step": str(self.step),
            "stepvault.kind": self.kind,
            "stepvault.manifest_blake3": self.manifest_id,
            "stepvault.logical_bytes": str(self.logical_bytes),
            "stepvault.stored_bytes": str(self.stored_bytes),
        }


def committed_checkpoint(store: Store, run: str, step: int) -> CommittedCheckpoint:
    """The record of ``run@step`` in ``store`` (one summary row; no tensor is read)."""
    records = checkpoint_records(store, run, steps=[step], protected=False)
    if not records or not records[0].valid:
        why = records[0].error if records else "not committed"
        raise LookupError(f"checkpoint {run}@{step} in {store.backend.url}: {why}")
    r = records[0]
    return CommittedCheckpoint(
        run=run,
        step=step,
        kind=r.kind,
        epoch=r.epoch,
        root=store.backend.url,
        manifest_id=r.manifest_id,
        logical_bytes=r.logical_bytes,
        stored_bytes=r.stored_bytes,
        metrics=dict(r.metrics),
    )


#: The queue's end-of-work mark.
_STOP = object()


class TrackerHook:
    """The background, retrying, never-stalling part of a tracker hook.

    A subclass sets ``tracker`` and implements :meth:`record` (the tracker calls for one
    checkpoint; returns ``(ref, name)``: where the tracker shows it and under what name).

    Parameters:
        retries: tries after the first one before ``tracker_failed`` is recorded.
        backoff: seconds before the first retry, doubled for each later one.
        close_timeout: how long ``mgr.close()`` waits for the records still queued.
        max_pending: checkpoints queued at most; a save that finds the queue full is
            recorded as ``tracker_failed`` at once (the tracker is far behind: training
            never waits for it).
    """

    tracker = "tracker"

    def __init__(
        self,
        *,
        retries: int = 3,
        backoff: float = 1.0,
        close_timeout: float = 30.0,
        max_pending: int = 64,
    ) -> None:
        if retries < 0 or backoff < 0 or close_timeout < 0 or max_pending < 1:
            raise ValueError(
                "retries, backoff and close_timeout must be >= 0 and max_pending >= 1, got "
                f"{retries}, {backoff}, {close_timeout}, {max_pending}"
            )
        self.retries = retries
        self.backoff = backoff
        self.close_timeout = close_timeout
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._context: HookContext | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._deadline = float("inf")  # set by close()
        self._lock = threading.Lock()
        self._current: int | None = None  # the step the thread is recording
        self._abandoned = False  # close() has recorded what was left
        #: ``(step, ref, name)`` of each checkpoint recorded, in order (for tests and logs)
        self.recorded: list[tuple[int, str, str]] = []
        #: ``(step, error)`` of each checkpoint the tracker did not get
        self.failed: list[tuple[int, str]] = []

    # -- the tracker's part -----------------------------------------------------------
    def setup(self, context: HookContext) -> None:
        """Called once on the training thread at construction (capture what is
        thread-local there, such as an active tracker run). Default: nothing."""

    def record(self, ckpt: CommittedCheckpoint) -> tuple[str, str]:
        """Tell the tracker about ``ckpt`` (on the hook's thread); ``(ref, name)``."""
        raise NotImplementedError

    # -- the hook protocol (manager/hooks.py) -------------------------------------------
    def attach(self, context: HookContext) -> None:
        """Bind to the manager's run; starts the hook's thread (coordinator only)."""
        if self._context is not None:
            raise RuntimeError(f"{self!r} is already attached to run {self._context.run!r}")
        self._context = context
        if not context.coordinator:
            return  # under a process group rank 0 records for the run
        self.setup(context)
        self._thread = threading.Thread(
            target=self._work, name=f"stepvault-{self.tracker}", daemon=True
        )
        self._thread.start()

    def __call__(self, info: SaveInfo) -> None:
        if self._thread is None or self._closing.is_set():
            return
        try:
            self._queue.put_nowait(info.step)
        except queue.Full:
            self._failed(
                info.step, f"the tracker is behind: {self._queue.maxsize} records still queued"
            )

    def close(self) -> None:
        """Wait up to ``close_timeout`` for the queued records; what is not recorded by
        then (queued or in flight) is recorded as ``tracker_failed``, and the hook
        writes nothing after it returns (its thread, a daemon, may still be blocked in a
        tracker call)."""
        thread = self._thread
        if thread is None or self._closing.is_set():
            return
        self._deadline = time.monotonic() + self.close_timeout
        self._closing.set()  # cuts a retry's backoff short
        while thread.is_alive() and time.monotonic() < self._deadline:
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                continue
        thread.join(max(0.0, self._deadline - time.monotonic()))
        with self._lock:
            self._abandoned = True
            left = [self._current] if self._current is not None else []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    left.append(item)
        for step in left:
            self._failed(step, f"not recorded before close ({self.close_timeout:g} s)")

    # -- the thread -----------------------------------------------------------------------
    def _work(self) -> None:
        assert self._context is not None
        context = self._context
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            with self._lock:
                if self._abandoned:
                    return
                self._current = int(item)
            self._one(context, int(item))

    def _one(self, context: HookContext, step: int) -> None:
        delay = self.backoff
        error = ""
        ckpt: CommittedCheckpoint | None = None
        for attempt in range(self.retries + 1):
            try:
                if ckpt is None:  # read once: a retry repeats the tracker's calls only
                    ckpt = committed_checkpoint(context.store, context.run, step)
                ref, name = self.record(ckpt)
            except Exception as exc:  # the tracker's own errors vary; every one is retried
                error = f"{type(exc).__name__}: {exc}"
                if attempt < self.retries and not self._wait(delay):
                    delay *= 2
                    continue
                break
            with self._lock:
                self._current = None
                if self._abandoned:  # close() gave up on it and said so
                    return
                self.recorded.append((step, ref, name))
            context.event("tracker_ref", step=step, tracker=self.tracker, ref=ref, name=name)
            return
        with self._lock:
            self._current = None
            if self._abandoned:
                return
        self._failed(step, error)

    def _wait(self, seconds: float) -> bool:
        """Sleep before a retry (cut short by close); True when no time is left to retry."""
        self._closing.wait(seconds)
        return self._closing.is_set() and time.monotonic() >= self._deadline

    def _failed(self, step: int, error: str) -> None:
        self.failed.append((step, error))
        if self._context is not None:
            self._context.event("tracker_failed", step=step, tracker=self.tracker, error=error)
        warnings.warn(
            f"stepvault could not record checkpoint {step} in {self.tracker}: {error} "
            "(training goes on; the 'tracker_failed' event keeps the reason)",
            RuntimeWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
