"""Host memory copies spread over the cores (staging on save, placement on restore).

numpy's ``copyto`` releases the GIL and runs at memory speed (torch's ``copy_`` measured
2-4x slower for plain CPU byte copies on these machines), but one thread copies at one
core's bandwidth: a 1.5 GB state took 0.19 s on one thread against 0.11 s for torch
(which faults and copies on every core). Large copies are cut into pieces so that a state
dominated by one big tensor (an embedding) still uses every core.

The staging copy of an asynchronous save (the only part of it training waits for) goes
through :func:`copy_spans`: its plan is a list of ``(dst, src, nbytes)`` addresses built
once per state layout, cut into one contiguous share of bytes per core, and the calling
thread copies the first share itself. Measured on 2 cores, 1.5 GB GPT-2 state + AdamW
moments: building numpy views per tensor and per save cost 2-10 ms of Python, and 16 MiB
pieces handed to the pool one by one left the copy at one core's speed (0.13 s); one
share per core copied it in 0.07-0.10 s.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Below this many bytes in total a copy stays on the calling thread (the hand-off costs
#: more than it saves).
PARALLEL_FROM = 64 << 20
#: Pieces of a large copy handed to the pool.
PIECE = 16 << 20
#: Shares of :func:`split_spans` start at multiples of this (whole pages per thread).
SHARE_ALIGN = 4096
#: Bytes per piece of a staging copy that threads take one at a time.
STAGE_PIECE = 8 << 20

#: ``(destination address, source address, nbytes)``: one byte range to copy.
Span = tuple[int, int, int]

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# ctypes calls foreign functions with the GIL released: the copies run truly in parallel.
_memmove = ctypes.memmove


def copy_threads() -> int:
    """Threads a large host copy is spread over: the cores this process may use, at most 4
    (memory bandwidth, not cores, is the limit beyond that)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=copy_threads(), thread_name_prefix="stepvault-copy"
            )
        return _POOL


def _pieces(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for dst, src in pairs:
        n = src.nbytes
        if n <= PIECE or dst.ndim != 1 or src.ndim != 1 or dst.itemsize != 1:
            out.append((dst, src))
            continue
        for at in range(0, n, PIECE):
            out.append((dst[at : at + PIECE], src[at : at + PIECE]))
    return out


def parallel_copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy every ``(dst, src)`` pair of host arrays; all done when this returns.

    Flat byte arrays (``uint8``, one dimension) are cut into pieces of :data:`PIECE`
    bytes; with :data:`PARALLEL_FROM` bytes or more in total the pieces run on a small
    shared thread pool, one per core.
    """
    total = sum(src.nbytes for _, src in pairs)
    if total < PARALLEL_FROM or (os.cpu_count() or 1) < 2:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    pieces = _pieces(pairs)
    if len(pieces) < 2:
        for dst, src in pieces:
            np.copyto(dst, src)
        return
    list(_pool().map(lambda pair: np.copyto(*pair), pieces))


def split_spans(spans: list[Span], shares: int) -> list[list[Span]]:
    """Cut ``spans`` into at most ``shares`` lists holding about the same number of bytes,
    in order; a span crossing a boundary is split there (boundaries fall on multiples of
    :data:`SHARE_ALIGN` bytes into the copy)."""
    total = sum(n for _, _, n in spans)
    if shares <= 1 or total < 2 * SHARE_ALIGN:
        return [list(spans)] if spans else []
    step = -(-total // shares)
    step = -(-step // SHARE_ALIGN) * SHARE_ALIGN
    out: list[list[Span]] = [[]]
    room = step  # bytes the current share still takes
    for dst, src, n in spans:
        while n > 0:
            if room == 0:
                out.append([])
                room = step
            take = min(n, room)
            out[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
    return out


def _run(share: list[Span]) -> None:
    for dst, src, n in share:
        _memmove(dst, src, n)


def copy_spans(pieces: list[list[Span]], threads: int | None = None) -> None:
    """Copy every span of every piece (see :func:`split_spans`) on up to ``threads``
    threads (default :func:`copy_threads`); all done when this returns.

    The calling thread copies too, and every thread takes the next piece not yet taken:
    when another process holds a core, the free ones copy the rest instead of waiting for
    a fixed share of the busy one.

    The caller guarantees that every address is valid for its length for the whole call
    (the memory is owned by objects it holds) and that no two destinations overlap.
    """
    threads = min(threads or copy_threads(), len(pieces))
    if threads <= 1:
        for piece in pieces:
            _run(piece)
        return
    taken = itertools.count()  # next() on it is atomic: each piece goes to one thread

    def work() -> None:
        for i in taken:
            if i >= len(pieces):
                return
            _run(pieces[i])

    futures = [_pool().submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for f in futures:  # never return (or raise) while a worker still writes
            f.result()
