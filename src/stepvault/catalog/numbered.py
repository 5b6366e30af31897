"""Numbered records created exclusively: ``<prefix>/<step>.<n>.json``, never overwritten.

Annotations and attachment records are append-only: each writer takes the next free number
and creates its file with ``overwrite=False``; a writer that loses the race to a concurrent
one (``FileExistsError``) re-reads the listing and takes the number after it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..store import Store

#: Tries before giving up: each failed try means another writer just took a number.
TRIES = 100


def put_numbered(
    store: Store, prefix: str, step: int, data: bytes, next_number: Callable[[], int]
) -> str | None:
    """Create ``<prefix>/<step>.<n>.json`` with ``n = next_number()`` (re-asked after each
    lost race); the key written, or None after :data:`TRIES` lost races."""
    for _ in range(TRIES):
        key = f"{prefix}/{step}.{next_number()}.json"
        try:
            store.backend.put_atomic(key, [data], overwrite=False)
        except FileExistsError:
            continue
        return key
    return None
