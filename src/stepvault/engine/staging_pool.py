"""Staging areas of one manager under a host-memory budget, prepared off the training thread.

A first save that allocates its staging buffers page-faults every byte on the training
thread (fresh memory faults in at ~0.6 GB/s here: a 400 MB state stalled 0.60 s against
0.26 s for a synchronous save). So areas are allocated and pre-faulted by a background
thread as soon as the manager sees the state (:meth:`StagingPool.prepare`), and a save
only ever takes an area that is ready (:meth:`StagingPool.acquire`); when none is, the
caller writes that save synchronously (a stall of a synchronous save, no more) while the
preparation goes on.

The budget: each area holds one copy of the state (1.0x), one save in flight uses one
area, so ``budget // state size`` saves may be in flight (at most :data:`MAX_IN_FLIGHT`).
Without a budget there is one area (one save in flight, as before). A state larger than
the budget is never staged: every save of it is synchronous.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .staging_area import StagingArea, aligned_total, signature_of

#: A due save waits for a preparation in flight of a state below this size (faulting it in
#: takes milliseconds, less than the fsyncs of a synchronous save); a larger one is
#: written synchronously instead.
WAIT_FOR_PREPARE_BELOW = 4 << 20
#: Saves in flight at most, whatever the budget (the writer runs them one after another;
#: more queued copies only hold memory).
MAX_IN_FLIGHT = 4


class StagingPool:
    """The staging areas of one manager (thread-safe)."""

    def __init__(self, budget: int | None = None, *, pin_memory: bool | None = None) -> None:
        self.budget = budget
        self.pin_memory = pin_memory
        self._areas: list[StagingArea] = []
        self._free: list[StagingArea] = []
        self._lock = threading.Lock()
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepvault-staging")
        self._pending: Future | None = None
        #: a prepare() asked for while a preparation ran: (arrays, signature, reserve)
        self._follow_up: tuple[dict[str, Any], tuple, int] | None = None
        self._state_bytes: int | None = None
        self._closed = False
        #: most host memory held for staging at any time
        self.peak_bytes = 0

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        """Host memory held for staging now."""
        with self._lock:
            return sum(a.nbytes for a in self._areas)

    @property
    def ready(self) -> bool:
        """Whether a free area is ready for the state last seen."""
        with self._lock:
            return any(a._faulted and a._sizes for a in self._free)

    def slots(self, state_bytes: int | None = None) -> int:
        """Saves that may be in flight for a state of ``state_bytes`` (0: too big to stage)."""
        n = self._state_bytes if state_bytes is None else state_bytes
        if self.budget is None:
            return 1
        if not n:
            return MAX_IN_FLIGHT
        return min(MAX_IN_FLIGHT, self.budget // n)

    # ------------------------------------------------------------------ preparing
    def prepare(self, arrays: dict[str, Any], *, reserve: int = 0) -> Future | None:
        """Allocate and pre-fault areas for a state shaped like ``arrays`` (plus
        ``reserve`` bytes for entries that are not in it) in the background: every free
        area, and one more while the budget allows (the next save in flight). Returns the
        background job (None when there is nothing to do)."""
        signature = signature_of(arrays)  # on the caller's thread: the state as it is now
        state_bytes = aligned_total(signature) + reserve
        with self._lock:
            if self._closed:
                return None
            self._state_bytes = state_bytes
            job = self._pending
            if job is not None and not job.done():
                # The areas being prepared are out of the free list, so what this state
                # needs is decided once that job is done (it may be for an older shape:
                # an optimizer without its moments yet). Only the newest request counts.
                first = self._follow_up is None
                self._follow_up = (dict(arrays), signature, reserve)
                if first:
                    self._pending = self._preparer.submit(self._run_follow_up)
                return self._pending
            return self._submit_locked(arrays, signature, reserve)

    def _run_follow_up(self) -> None:
        with self._lock:
            request, self._follow_up = self._follow_up, None
            if request is None or self._closed:
                return
            arrays, signature, reserve = request
            todo = self._select_locked(signature)
        if todo:
            self._prepare(todo, arrays, signature, reserve)

    def _submit_locked(
        self, arrays: dict[str, Any], signature: tuple, reserve: int
    ) -> Future | None:
        todo = self._select_locked(signature)
        if not todo:
            return None
        arrays = dict(arrays)  # keeps the tensors alive until their layout is read
        job = self._preparer.submit(self._prepare, todo, arrays, signature, reserve)
        self._pending = job
        return job

    def _select_locked(self, signature: tuple) -> list[StagingArea]:
        """The areas to prepare for ``signature``, taken out of the free list (acquire
        skips them while they are prepared); the caller holds the lock."""
        todo = [a for a in self._free if not a.ready_for(signature)]
        ready = any(a.ready_for(signature) for a in self._free)
        if not ready and not todo and len(self._areas) < self.slots():
            area = StagingArea(pin_memory=self.pin_memory)
            self._areas.append(area)
            self._free.append(area)
            todo.append(area)
        for a in todo:
            self._free.remove(a)
        return todo

    def _prepare(
        self, areas: list[StagingArea], arrays: dict[str, Any], signature: tuple, reserve: int
    ) -> None:
        try:
            for area in areas:
                with self._lock:
                    others = sum(a.nbytes for a in self._areas if a is not area)
                need = aligned_total(signature) + reserve
                if self.budget is not None and others + need > self.budget:
                    area.release()  # would pass the budget: this area goes
                    with self._lock:
                        self._areas.remove(area)
                    continue
                # (a changed layout's old block is unmapped before the new one is mapped)
                area.prepare(arrays, signature, reserve=reserve)
                with self._lock:
                    self.peak_bytes = max(self.peak_bytes, sum(a.nbytes for a in self._areas))
        finally:
            with self._lock:
                self._free.extend(a for a in areas if a in self._areas)

    @property
    def preparing(self) -> bool:
        """Whether a background preparation is running."""
        job = self._pending
        return job is not None and not job.done()

    def wait_prepared(self, timeout: float | None = None) -> None:
        """Block until the background preparation (if any) is done (tests, benchmarks)."""
        job = self._pending
        if job is not None:
            job.result(timeout)

    # ------------------------------------------------------------------- saving
    def acquire(self, arrays: dict[str, Any]) -> StagingArea | None:
        """A free area ready for ``arrays`` (never allocates), or None: then the caller
        saves synchronously and calls :meth:`prepare` after it."""
        signature = signature_of(arrays)
        if self.preparing and aligned_total(signature) < WAIT_FOR_PREPARE_BELOW:
            try:
                self.wait_prepared()
            except Exception:  # a failed preparation: this save is synchronous instead
                pass
        with self._lock:
            for area in self._free:
                if area.ready_for(signature):
                    self._free.remove(area)
                    break
            else:
                area = None
        if area is not None:
            # The next save in flight gets an area of its own, prepared while this writes.
            # (With none ready the caller prepares after its synchronous write: faulting
            # in memory during it slowed it by up to 1.5x on 2 cores.)
            self.prepare(arrays)
        return area

    def release(self, area: StagingArea) -> None:
        """Give back an area whose save has read its bytes."""
        with self._lock:
            if area in self._areas and area not in self._free:
                self._free.append(area)

    def pause(self) -> None:
        """Pause pre-faulting between pieces (a synchronous save is running)."""
        for area in list(self._areas):
            area.may_fault.clear()

    def resume(self) -> None:
        for area in list(self._areas):
            area.may_fault.set()

    def close(self) -> None:
        """Free every area (waiting for a preparation in flight)."""
        with self._lock:
            self._closed = True
        self.resume()
        self._preparer.shutdown(wait=True)
        with self._lock:
            areas, self._areas, self._free = self._areas, [], []
        for area in areas:
            area.release()
