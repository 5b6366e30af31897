"""Content hashing: BLAKE3 over the raw (decoded) bytes; the hex digest names the object."""

from __future__ import annotations

from blake3 import blake3

#: Above this size hashing uses several threads (BLAKE3 is parallel by construction).
_PARALLEL_FROM = 4 << 20


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Hex BLAKE3-256 digest of ``data``; releases the GIL, multithreaded for large inputs."""
    if type(data) is bytes and len(data) < _PARALLEL_FROM:
        return blake3(data).hexdigest()  # small (manifests, cache lines): no view, one thread
    view = memoryview(data).cast("B")
    threads = blake3.AUTO if view.nbytes >= _PARALLEL_FROM else 1
    return blake3(view, max_threads=threads).hexdigest()
