"""Content hashing: BLAKE3 over the raw (decoded) bytes; the hex digest names the object."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from blake3 import blake3

#: Above this size hashing uses several threads (BLAKE3 is parallel by construction).
_PARALLEL_FROM = 4 << 20

_local = threading.local()


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Hex BLAKE3-256 digest of ``data``; releases the GIL, multithreaded for large inputs
    (single-threaded inside :func:`one_thread_per_hash`)."""
    if type(data) is bytes and len(data) < _PARALLEL_FROM:
        return blake3(data).hexdigest()  # small (manifests, cache lines): no view, one thread
    view = memoryview(data).cast("B")
    many = view.nbytes >= _PARALLEL_FROM and not getattr(_local, "single", False)
    return blake3(view, max_threads=blake3.AUTO if many else 1).hexdigest()


@contextmanager
def one_thread_per_hash() -> Iterator[None]:
    """Hash on the calling thread only, for pools that already keep every core hashing.

    BLAKE3's own threads on top of a pool of one thread per core oversubscribe the cores:
    verifying 537 MB of objects from /dev/shm with 2 pool threads took 0.23 s with
    ``max_threads=AUTO`` and 0.12 s with one thread per hash (2 cores)."""
    before = getattr(_local, "single", False)
    _local.single = True
    try:
        yield
    finally:
        _local.single = before
