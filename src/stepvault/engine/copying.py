"""Host memory copies spread over the cores (staging on save, placement on restore).

numpy's ``copyto`` releases the GIL and runs at memory speed (torch's ``copy_`` measured
2-4x slower for plain CPU byte copies on these machines), but one thread copies at one
core's bandwidth: a 1.5 GB state took 0.19 s on one thread against 0.11 s for torch
(which faults and copies on every core). Large copies are cut into pieces so that a state
dominated by one big tensor (an embedding) still uses every core.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Below this many bytes in total a copy stays on the calling thread (the hand-off costs
#: more than it saves).
PARALLEL_FROM = 64 << 20
#: Pieces of a large copy handed to the pool.
PIECE = 16 << 20

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 2), thread_name_prefix="stepvault-copy"
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
