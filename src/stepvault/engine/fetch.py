"""Fetching and verifying objects: one object (:func:`fetch_object`), many in a pipeline
(:func:`fetch_pipelined`: reads run ahead of verification within a byte budget), the
verification modes and the signed-checkpoint rule (FORMAT.md §3.3)."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from ..errors import CorruptObjectError, MissingObjectError
from ..format.hashing import check_segments, one_thread_per_hash
from ..format.objects import ObjectHeader, SegmentSums, decode_object
from ..format.xor_codec import MAX_CHAIN
from ..store import Store
from .writer import default_workers

#: How a read verifies objects: ``"fast"`` with their segment checksums where recorded
#: (BLAKE3 otherwise), ``"full"`` always with BLAKE3 (signed checkpoints, ``verify --deep``).
VerifyMode = Literal["fast", "full"]
VERIFY_MODES = ("fast", "full")

#: Bytes a whole-checkpoint read fetches ahead of verification (memory for remote objects,
#: page cache for mapped local ones).
DEFAULT_READ_AHEAD = 512 << 20


def check_verify_mode(verify: str) -> VerifyMode:
    """``verify`` if it is a known mode, else a ValueError naming the choices."""
    if verify not in VERIFY_MODES:
        raise ValueError(
            f"verify={verify!r}: use 'fast' (segment checksums where recorded, the default) "
            "or 'full' (BLAKE3 of every byte)"
        )
    return verify  # type: ignore[return-value]


def is_signed(store: Store, run: str, step: int) -> bool:
    """Whether ``run@step`` has a signature record in ``store`` (any tier of a view); an
    unreadable one counts as signed (the careful reading)."""
    try:
        return store.read_signature(run, step) is not None
    except Exception:  # any doubt reads with BLAKE3
        return True


def read_object_bytes(store: Store, digest: str) -> memoryview | bytes:
    """The stored (encoded) bytes of one object: a private map on local disk (the kernel
    reads it ahead), else the downloaded bytes. Errors are store errors of the object."""
    try:
        buf: memoryview | bytes | None = store.map_object(digest)
        if buf is None:
            buf = store.read_object(digest)
        return buf
    except FileNotFoundError:
        raise MissingObjectError(
            f"object {digest[:16]}… is missing from {store.backend.url}"
        ) from None
    except OSError as exc:
        # ELOOP (a symlink planted in the store), EISDIR, EACCES...: never followed, never
        # fatal to the fallback logic; the object is simply unusable.
        err = CorruptObjectError(f"object {digest[:16]}… cannot be read safely: {exc}")
        err.digest = digest
        raise err from None


def fetch_object(
    store: Store,
    digest: str,
    *,
    verify: bool = True,
    max_chain: int = MAX_CHAIN,
    fast: bool = False,
    buf: memoryview | bytes | None = None,
) -> memoryview:
    """Decoded, verified bytes of one object (a private copy-on-write map when raw on disk).

    ``fast``: verify with the object's segment checksums where it has them (BLAKE3
    otherwise); ``buf``: its stored bytes, already read (:func:`read_object_bytes`). A
    delta object's base is fetched from ``store`` too (through a tier view: from any
    tier), verified, with a chain at most ``max_chain`` links long."""
    if buf is None:
        buf = read_object_bytes(store, digest)
    try:
        raw = decode_object(
            buf,
            digest,
            verify=verify,
            base=base_reader(store, fast=fast),
            max_chain=max_chain,
            fast=fast,
        )
    except CorruptObjectError as exc:
        if exc.digest is None:  # a damaged base keeps its own name: that one is set aside
            exc.digest = digest
        raise
    if raw.readonly:
        raw = memoryview(bytearray(raw))
    return raw


def base_reader(store: Store, *, fast: bool = False) -> Callable[[str, int], memoryview]:
    """Reads delta bases from ``store`` (for :func:`~stepvault.format.objects.decode_object`)."""
    return lambda digest, max_chain: fetch_object(store, digest, max_chain=max_chain, fast=fast)


#: Segments each thread checks, at least, when a partial read spreads its checks.
SEGMENTS_PER_THREAD = 4
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def segment_pool() -> ThreadPoolExecutor:
    """Threads that check the segments of one large partial read (made once, kept)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=default_workers(), thread_name_prefix="stepvault-verify"
            )
        return _pool


def idle_cores() -> int:
    """Cores no process is using, by the 1-minute load average (0 when it is unknown).

    Measured on 2 cores at load 9 (one 25 MB tensor, 400 alternations): checks shared with
    a helper thread took 7.4 ms (p50), on the calling thread alone 2.4 ms."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return 0
    return max(0, int((os.cpu_count() or 1) - load))


def check_segment_range(
    raw: memoryview, sums: SegmentSums, first: int, last: int, workers: int
) -> int | None:
    """Check segments ``first`` .. ``last`` (inclusive) of ``raw``, the whole decoded object,
    against ``sums``; a bad one's index, or None when all match.

    Many segments (a large tensor) are shared with up to ``workers - 1`` pool threads
    (xxhash releases the GIL): every thread, the calling one included, takes the next
    segment not yet taken, and helpers that have not started when the caller runs out are
    cancelled. So a free core halves the time, and a core held by another process costs
    at most the one segment its helper is in, never a fixed share (measured on 2 busy
    cores: a fixed share per thread made one 25 MB tensor 2-5x slower than one thread).
    A few segments, or no idle core (:func:`idle_cores`), and they are checked here: a
    hand-off costs more than it saves, and a helper waiting for a core holds the GIL
    between segments when it runs."""
    count = last - first + 1
    helpers = min(workers, count // SEGMENTS_PER_THREAD, 1 + idle_cores()) - 1
    if helpers < 1:
        return check_segments(raw, sums.hex, sums.segment, first, last)
    taken = itertools.count(first)  # next() on it is atomic: each segment to one thread
    bad: list[int] = []

    def work() -> None:
        for i in taken:
            if i > last or bad:
                return
            if check_segments(raw, sums.hex, sums.segment, i, i) is not None:
                bad.append(i)
                return

    pool = segment_pool()
    others = [pool.submit(work) for _ in range(helpers)]
    try:
        work()
    finally:
        for f in others:  # never return while a helper still reads ``raw``
            if not f.cancel():
                f.result()
    return min(bad) if bad else None


class _ByteBudget:
    """At most ``limit`` bytes taken at once (one item of any size when none is taken),
    granted in order: item ``seq`` only after item ``seq - 1``. In order, because the
    verifiers consume in order: were a later read granted first, the budget could fill
    with objects no verifier reaches while the one they wait for can never be read.
    :meth:`stop` wakes every waiter for good (a failed read ends the pipeline)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.next = 0
        self.stopped = False
        self._cond = threading.Condition()

    def take(self, seq: int, n: int) -> bool:
        with self._cond:
            while not self.stopped and (
                seq != self.next or (self.taken and self.taken + n > self.limit)
            ):
                self._cond.wait()
            if self.stopped:
                return False
            self.taken += n
            self.next += 1
            self._cond.notify_all()
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self.taken -= n
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


class PartialObject:
    """A raw object mapped but not verified whole: the segments verified so far."""

    __slots__ = ("header", "raw", "verified")

    def __init__(self, header: ObjectHeader, raw: memoryview) -> None:
        self.header = header
        self.raw = raw
        self.verified: set[int] = set()


def fetch_pipelined(
    store: Store,
    todo: Sequence[str],
    sizes: dict[str, int],
    *,
    workers: int,
    read_ahead: int,
    fast: bool,
    verified: Callable[[str, memoryview], None],
    progress: Callable[[int, int | None], None] | None = None,
) -> None:
    """Fetch and verify the objects ``todo`` (stored sizes in ``sizes``), pipelined;
    ``verified(digest, raw)`` gets each one in order, ``progress(done, total)`` the stored
    bytes verified so far; raises on the first damaged one.

    Reader threads fetch objects in order, at most ``read_ahead`` bytes ahead of the
    ``workers`` verifier threads, which check each one as soon as it is there: the reads
    of the next objects overlap the verification of the current ones."""
    if not todo:
        return
    total, done = sum(sizes.get(d, 0) for d in todo), 0
    # With at least one object per thread the pool keeps every core busy; BLAKE3's own
    # threads are for fewer, larger objects.
    spread = len(todo) >= workers
    budget = _ByteBudget(read_ahead)

    def read(seq: int, digest: str) -> memoryview | bytes | None:
        if not budget.take(seq, sizes.get(digest, 0)):
            return None  # the pipeline stopped (an earlier object failed)
        return read_object_bytes(store, digest)

    def verify(digest: str, fetched: Future[memoryview | bytes | None]) -> memoryview:
        try:
            buf = fetched.result()
            if buf is None:
                raise CorruptObjectError("the read pipeline stopped")
            if not spread:
                return fetch_object(store, digest, fast=fast, buf=buf)
            with one_thread_per_hash():
                return fetch_object(store, digest, fast=fast, buf=buf)
        finally:
            budget.give(sizes.get(digest, 0))

    # Reads wait on the device (or the network), not on a core: more of them than
    # verifier threads keeps the storage busy.
    readers = ThreadPoolExecutor(max_workers=max(4, 2 * workers))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            reads = [readers.submit(read, i, d) for i, d in enumerate(todo)]
            checks = [pool.submit(verify, d, f) for d, f in zip(todo, reads)]
            for digest, check in zip(todo, checks):
                try:
                    raw = check.result()
                except BaseException:
                    budget.stop()
                    for c in checks:
                        c.cancel()
                    raise
                verified(digest, raw)
                if progress is not None:
                    done += sizes.get(digest, 0)
                    progress(done, total)
    finally:
        budget.stop()
        readers.shutdown(wait=True, cancel_futures=True)
