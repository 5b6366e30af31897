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


# --- Segment checksums: the cheap verification on read (FORMAT.md §3.3) -----------------
#
# BLAKE3 names objects (dedup, verify --deep, signatures); a read verifies with xxh3-128 of
# each segment of the decoded bytes, recorded in the object header at save: 0.05 CPU-s/GB
# against BLAKE3's 0.16 here, and a partial read checks only the segments it uses.

#: The checksum recorded per segment (128-bit: a random corruption goes unseen with
#: probability 2**-128, like a truncated cryptographic hash; not collision resistant, so
#: never used where a forger could choose the bytes: signed checkpoints read with BLAKE3).
SUM_ALG = "xxh3-128"
#: Segment size of the recorded checksums (a partial read verifies whole segments).
SUM_SEGMENT = 1 << 20
_SUM_HEX = 32

try:  # optional (extra "fast"): without it saves record no sums and reads use BLAKE3
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - the dev install has it
    _xxhash = None  # type: ignore[assignment]


def sums_available() -> bool:
    """Whether segment checksums can be computed here (the ``xxhash`` package)."""
    return _xxhash is not None


def segment_sums(raw: memoryview, segment: int = SUM_SEGMENT) -> str | None:
    """The concatenated hex xxh3-128 of each ``segment`` bytes of ``raw`` (the last one
    shorter), or None without ``xxhash``."""
    if _xxhash is None:
        return None
    view = memoryview(raw).cast("B")
    return "".join(
        _xxhash.xxh3_128_hexdigest(view[at : at + segment]) for at in range(0, view.nbytes, segment)
    )


def check_segments(
    raw: memoryview, sums: str, segment: int, first: int = 0, last: int | None = None
) -> int | None:
    """Check segments ``first`` .. ``last`` (inclusive; default: all) of the whole decoded
    ``raw`` against ``sums``; returns the first bad segment's index, or None when all match.

    Raises RuntimeError without ``xxhash`` (callers check :func:`sums_available`)."""
    if _xxhash is None:
        raise RuntimeError("segment checksums need the 'xxhash' package")
    view = memoryview(raw).cast("B")
    count = -(-view.nbytes // segment)
    last = count - 1 if last is None else last
    for i in range(first, last + 1):
        got = _xxhash.xxh3_128_hexdigest(view[i * segment : (i + 1) * segment])
        if got != sums[i * _SUM_HEX : (i + 1) * _SUM_HEX]:
            return i
    return None


def sums_fit(sums: str, segment: int, raw_size: int) -> bool:
    """Whether a recorded ``sums`` string has one checksum per segment of ``raw_size``."""
    return len(sums) == _SUM_HEX * -(-raw_size // segment)
