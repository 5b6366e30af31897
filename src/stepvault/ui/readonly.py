"""A backend wrapper that refuses every write, so that browsing never changes a store.

Readers such as :meth:`stepvault.Vault.checkpoints` opportunistically write caches (the
run's summary file); they already treat a failed write as "no cache". Wrapping the backend
makes "opening the dashboard never writes to the store" hold by construction rather than by
care in each page.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import ReadOnlyError
from ..store.backend import Backend


class ReadOnlyBackend(Backend):
    """A :class:`Backend` that reads through ``inner`` and raises :class:`ReadOnlyError`
    on every write (every method of the interface is listed: nothing writes by default)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.append_is_cheap = inner.append_is_cheap

    # -- reads ---------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        return self.inner.read_bytes(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(key, offset, length)

    def read_many(self, folder: str, names: Sequence[str]) -> Iterator[bytes | OSError]:
        return self.inner.read_many(folder, names)

    def map(self, key: str) -> memoryview | None:
        return self.inner.map(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def mtime(self, key: str) -> float:
        return self.inner.mtime(key)

    def sync(self) -> None:  # nothing was written, so nothing to make durable
        return None

    def close(self) -> None:
        self.inner.close()

    # -- writes --------------------------------------------------------------------------
    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ReadOnlyError(
            f"the dashboard opened {self.url} read-only; start it with --allow-actions to "
            "change the store"
        )

    put_atomic = put_staged = publish = discard = delete = touch = append = _refuse
