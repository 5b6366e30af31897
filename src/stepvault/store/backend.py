"""The byte-level backend interface every storage location implements.

Keys are relative, ``/``-separated paths (``objects/ab/abcd...``). A backend knows nothing
of tensors, manifests or hashes; it only moves bytes, and it offers exactly one way to make
something visible: :meth:`Backend.put_atomic`, which never exposes a partially written key.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

from ..errors import PreconditionFailed

Buffer = bytes | bytearray | memoryview


def content_version(data: bytes) -> str:
    """The version tag of ``data`` where a backend has no native one (S3 uses the ETag)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class Backend(abc.ABC):
    """Abstract storage backend (a local directory, or any fsspec filesystem such as S3)."""

    #: Human-readable location, used in error messages.
    url: str

    #: Whether :meth:`append` costs only the appended bytes (local files: O_APPEND). Object
    #: stores rewrite the whole key, so the event log writes one object per event there.
    append_is_cheap: bool = True

    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """Whole content of ``key``; ``FileNotFoundError`` when absent."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``key`` starting at ``offset`` (shorter at end of file)."""

    def read_many(self, folder: str, names: Sequence[str]) -> Iterator[bytes | OSError]:
        """The content of each ``folder/name`` in order, or the ``OSError`` reading it raised.

        Listings read thousands of small files of one folder; backends may do it faster
        than one :meth:`read_bytes` each.
        """
        for name in names:
            try:
                yield self.read_bytes(f"{folder}/{name}")
            except OSError as exc:
                yield exc

    def map(self, key: str) -> memoryview | None:
        """A read-only zero-copy view of ``key`` (memory map), or None if unsupported."""
        return None

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is visible."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names (not full keys) directly under the folder ``prefix``; empty when absent."""

    @abc.abstractmethod
    def put_atomic(
        self, key: str, parts: Sequence[Buffer], *, overwrite: bool = True, durable: bool = True
    ) -> None:
        """Write the concatenation of ``parts`` to ``key`` so that readers see all or nothing.

        With ``overwrite=False`` the write is create-if-absent and raises ``FileExistsError``
        when ``key`` already exists. With ``durable=True`` the data is on stable storage
        before the key becomes visible (local disks: fsync of the file; the directory entry
        is flushed by :meth:`sync`).
        """

    # -- fencing: compare-and-set and exclusion (the writer lease, store/lease.py) ----------
    #: Whether :meth:`exclusive` keeps out every other process that writes this store
    #: (local disks: ``flock``; ``memory://``: a process lock). Where it is False, only
    #: :meth:`replace_if` / :meth:`delete_if` themselves are atomic (S3: conditional
    #: requests), or nothing is (a check-then-act: other fsspec filesystems).
    exclusive_is_atomic: bool = False

    def exclusive(
        self, key: str, timeout: float = 30.0, *, abandoned: Callable[[], bool] | None = None
    ) -> AbstractContextManager[None]:
        """Hold ``key``'s lock while the block runs (excludes other holders of the same
        key's lock; no reader is affected). A no-op where the backend has no locks.

        ``abandoned``: asked while another process holds the lock; True means its holder
        has stopped (the lease the lock guards went stale), and a backend whose locks can
        outlive a stopped holder (local disks) may then break it.
        """
        return contextlib.nullcontext()

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """``key``'s bytes and a version tag for :meth:`replace_if` / :meth:`delete_if`."""
        data = self.read_bytes(key)
        return data, content_version(data)

    def replace_if(
        self, key: str, parts: Sequence[Buffer], expected: str | None, *, durable: bool = True
    ) -> str:
        """Compare-and-set: write ``key`` only if its version is still ``expected`` (None:
        only if absent); :class:`PreconditionFailed` otherwise. Returns the new version.

        This default checks, then writes: atomic only inside :meth:`exclusive` on a backend
        whose locks are (:attr:`exclusive_is_atomic`); object stores override it with a
        conditional request.
        """
        data = b"".join(memoryview(p).cast("B") for p in parts)
        if expected is None:
            try:
                self.put_atomic(key, [data], overwrite=False, durable=durable)
            except FileExistsError:
                raise PreconditionFailed(f"{self.url}/{key} already exists") from None
            return content_version(data)
        try:
            _, current = self.read_versioned(key)
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.url}/{key} is gone") from None
        if current != expected:
            raise PreconditionFailed(f"{self.url}/{key} changed")
        self.put_atomic(key, [data], overwrite=True, durable=durable)
        return content_version(data)

    def delete_if(self, key: str, expected: str) -> None:
        """Delete ``key`` only if its version is still ``expected`` (see :meth:`replace_if`)."""
        try:
            _, current = self.read_versioned(key)
        except FileNotFoundError:
            return
        if current != expected:
            raise PreconditionFailed(f"{self.url}/{key} changed")
        self.delete(key)

    def put_fenced(
        self,
        key: str,
        parts: Sequence[Buffer],
        fence: AbstractContextManager[object],
        *,
        overwrite: bool = True,
        durable: bool = True,
    ) -> None:
        """:meth:`put_atomic` with ``fence`` held around the moment ``key`` becomes visible.

        ``fence`` checks that the caller may still write (the writer lease's token) and
        raises if not: then nothing becomes visible and no temporary file is left. Backends
        with a rename write the bytes first and hold the fence only across the rename.
        """
        with fence:
            self.put_atomic(key, parts, overwrite=overwrite, durable=durable)

    def put_staged(self, key: str, parts: Sequence[Buffer]) -> object:
        """Write ``key`` durably-to-be but invisibly; :meth:`publish` makes a batch visible.

        A batch pays the durability cost once instead of per key (local disks: writeback of
        every file starts at once, and the fsyncs run together at publish). Backends without
        such a cost (object stores: a PUT is durable and atomic) write the key at once here.
        Returns a token for :meth:`publish` / :meth:`discard`.
        """
        self.put_atomic(key, parts, overwrite=True, durable=True)
        return None

    def publish(self, tokens: Sequence[object]) -> None:
        """Make staged keys durable, then visible (replacing any key of the same name)."""

    def discard(self, tokens: Sequence[object]) -> None:
        """Drop staged keys that will not be published (a failed save)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; missing keys are ignored."""

    def touch(self, key: str) -> bool | None:
        """Mark ``key`` as recently used (its modification time), for GC's grace period.

        Returns True when ``key`` was there, False when it is absent, None when this backend
        cannot tell (a save then asks :meth:`exists`)."""
        return None

    def mtime(self, key: str) -> float:
        """Modification time of ``key`` (Unix seconds); ``FileNotFoundError`` when absent."""
        raise NotImplementedError

    def append(self, key: str, data: bytes) -> None:
        """Append ``data`` to ``key`` (created if absent); used by the event log."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every visible name created so far durable (directory fsync on local disks)."""

    def close(self) -> None:
        """Release resources."""
