"""fsspec backend: a store on any fsspec filesystem (``s3://``, ``memory://``, ``gs://``, ...).

Object stores have no rename, so visibility cannot come from a temporary name. Instead:

* every key is written with **one** request (a PUT) or a multipart upload that becomes
  visible only when it is completed: a reader sees the whole object or nothing, never a
  prefix of it;
* create-if-absent (``put_atomic(..., overwrite=False)``, used to commit manifests and take
  leases) is a conditional write that the server decides: on S3 ``If-None-Match: *`` on the
  PUT (or on CompleteMultipartUpload), which fails with 412 when the key exists.

A retried conditional write is ambiguous: the first attempt may have succeeded and only its
response been lost, so the retry answers 412 for our own object. :meth:`put_atomic` then
compares the stored bytes with ours and treats an identical object as success (manifests
and lease records carry timestamps and tokens, so "identical" means "ours").

S3 requests go through s3fs/aiobotocore with botocore's ``standard`` retry mode (backoff with
jitter on 5xx, throttling, reset connections and timeouts), explicit connect/read timeouts,
and parallel multipart uploads for objects of ``2 * part_size`` bytes or more.

(Longer than most modules on purpose: one backend whose conditional writes, their
ambiguous retries and the translation of the server's errors are one set of rules.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..errors import StoreNotFoundError
from .backend import Backend, Buffer, PreconditionFailed
from .fs_cache import shared_filesystem
from .names import check_key

#: botocore settings for S3: bounded waits and retries with backoff on transient errors.
DEFAULT_S3_CONFIG: dict[str, Any] = {
    "retries": {"max_attempts": 8, "mode": "standard"},
    "connect_timeout": 10,
    "read_timeout": 120,
    "max_pool_connections": 64,
    # Uploads carry a checksum (CRC32) that S3 validates before the PUT succeeds: a body
    # damaged in transit is refused, never stored.
    "request_checksum_calculation": "when_supported",
    # Downloads are verified end to end by stepvault itself (each object's segment
    # checksums or BLAKE3, FORMAT.md 3.3), from the writer's buffer to the reader's: a
    # second pass of botocore over every full GET would only cost CPU.
    "response_checksum_validation": "when_required",
}
#: Objects of at least twice this size are uploaded as parallel multipart uploads. 32 MiB
#: keeps the default 32 MiB chunks single PUTs (fewer requests; measured faster here) and
#: splits only bigger objects, where one stream would be the bottleneck.
DEFAULT_PART_SIZE = 32 << 20
#: Objects larger than ``ranged_from`` (default ``2 * part_size``, 64 MiB: like uploads,
#: the default 32 MiB chunks stay single requests) are read in concurrent ranged GETs of
#: this size: one S3 stream runs far below what the network gives several (Run:ai's
#: streamer and the S3 transfer managers read large objects the same way). Smaller objects
#: are fetched many at once by the reader instead (measured on the loopback moto server,
#: where no network limits one stream: 8 MiB ranges of 32 MiB objects took 2x longer).
DEFAULT_RANGE_SIZE = 8 << 20

# memory:// lives in this process; its create-if-absent is a check-then-write, so one lock
# per process makes it atomic between threads. Reentrant: the lease holds it (exclusive())
# around a create-if-absent that takes it again.
_MEMORY_LOCK = threading.RLock()


def _translated(method: Callable[..., Any]) -> Callable[..., Any]:
    """Surface client-library errors (botocore's connection, timeout and credential errors
    are not OSErrors) as OSError naming the store, so callers handle one family."""

    @functools.wraps(method)
    def wrapper(self: FsspecBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError:
            raise
        except Exception as exc:
            if type(exc).__module__.split(".")[0] not in ("botocore", "aiobotocore", "aiohttp"):
                raise
            hint = ""
            if "Credentials" in type(exc).__name__:
                hint = " (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role)"
            raise OSError(f"{self.url}: {type(exc).__name__}: {exc}{hint}") from exc

    return wrapper


def _plain(data: Sequence[Buffer]) -> bytes:
    if len(data) == 1 and isinstance(data[0], bytes):
        return data[0]
    return b"".join(memoryview(p).cast("B") for p in data)


class FsspecBackend(Backend):
    """A store under ``root`` on an fsspec filesystem ``fs`` (see :func:`open_fsspec`)."""

    #: Appending rewrites the whole object here, so the event log writes one object per
    #: event instead (see :mod:`stepvault.catalog.events`).
    append_is_cheap = False

    def __init__(
        self,
        fs: Any,
        root: str,
        url: str,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        range_size: int = DEFAULT_RANGE_SIZE,
        ranged_from: int | None = None,
    ):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.part_size = int(part_size)
        #: objects larger than :attr:`ranged_from` are read in concurrent ranges of this size
        self.range_size = int(range_size)
        self.ranged_from = int(ranged_from or 2 * self.part_size)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol = protocol
        self.is_s3 = protocol in ("s3", "s3a")
        # memory:// lives in this process: its lock excludes every writer there is.
        self.exclusive_is_atomic = protocol == "memory"

    # -- helpers -----------------------------------------------------------------------
    def _path(self, key: str) -> str:
        key = check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, name = self._path(key).partition("/")
        return bucket, name

    # -- reads -------------------------------------------------------------------------
    @_translated
    def read_bytes(self, key: str) -> bytes:
        if self.is_s3:
            return self._read_ranged(self._path(key))
        return self.fs.cat_file(self._path(key))

    def _read_ranged(self, path: str) -> bytes:
        """The whole object: one ranged GET of its first :attr:`ranged_from` bytes (an
        object that fits is done: one request, as a plain GET), then the size (HEAD) and
        the rest in concurrent ranged GETs of :attr:`range_size`."""
        head = self.ranged_from
        first = self.fs.cat_file(path, start=0, end=head)
        if len(first) < head:
            return first
        total = self._size_of(path)
        if total <= head:
            return first[:total]
        size = self.range_size
        starts = list(range(head, total, size))
        rest = self.fs.cat_ranges(
            [path] * len(starts), starts, [min(total, a + size) for a in starts]
        )
        for piece in rest:
            if isinstance(piece, BaseException):
                raise piece
        out = bytearray(total)
        out[:head] = first
        for a, piece in zip(starts, rest):
            if len(piece) != min(total, a + size) - a:
                raise OSError(f"{self.url}: short ranged read of {path} at {a}")
            out[a : a + len(piece)] = piece
        return bytes(out)

    def _size_of(self, path: str) -> int:
        bucket, _, name = path.partition("/")
        return int(self.fs.call_s3("head_object", Bucket=bucket, Key=name)["ContentLength"])

    @_translated
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self.fs.cat_file(self._path(key), start=offset, end=offset + length)

    def _head(self, key: str) -> dict[str, Any]:
        # One HEAD of the exact key (fs.info would also LIST the prefix when it is absent).
        bucket, name = self._split(key)
        return self.fs.call_s3("head_object", Bucket=bucket, Key=name)

    @_translated
    def size(self, key: str) -> int:
        if self.is_s3:
            return int(self._head(key)["ContentLength"])
        return int(self.fs.size(self._path(key)))

    @_translated
    def exists(self, key: str) -> bool:
        path = self._path(key)
        if self.is_s3:
            # A HEAD of the exact key: fs.exists() would also count a "directory" prefix.
            try:
                self._head(key)
                return True
            except FileNotFoundError:
                return False
        return bool(self.fs.isfile(path))

    @_translated
    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix) if prefix else self.root
        try:
            if self.is_s3:
                entries = self.fs.ls(path, detail=False, refresh=True)
            else:
                entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = path.strip("/") + "/"
        names = set()
        for entry in entries:
            entry = entry.strip("/")
            if entry.startswith(base):
                name = entry[len(base) :]
                if name and "/" not in name:
                    names.add(name)
        return sorted(names)

    # -- writes ------------------------------------------------------------------------
    @_translated
    def put_atomic(
        self, key: str, parts: Sequence[Buffer], *, overwrite: bool = True, durable: bool = True
    ) -> None:
        # ``durable`` needs nothing more: an object store acknowledges a PUT once it is
        # stored redundantly, and a key is visible only after its upload completed.
        data = _plain(parts)
        path = self._path(key)
        if overwrite:
            self._pipe(path, data, create=False)
            return
        try:
            if self.protocol == "memory":
                with _MEMORY_LOCK:
                    self._pipe(path, data, create=True)
            else:
                self._pipe(path, data, create=True)
        except FileExistsError:
            # A retried conditional PUT whose first attempt went through answers 412 for
            # our own object: identical bytes mean the write happened, and it was ours.
            try:
                if self.fs.cat_file(path) == data:
                    return
            except FileNotFoundError:
                pass
            raise FileExistsError(f"{self.url}/{key} already exists") from None

    # -- fencing (store/lease.py): S3 conditional requests; a process lock for memory:// ---
    def exclusive(
        self, key: str, timeout: float = 30.0, *, abandoned: Callable[[], bool] | None = None
    ) -> AbstractContextManager[None]:
        # memory://: one process; a stopped holder stops the whole process, so nothing to break
        if self.protocol == "memory":
            return _held(_MEMORY_LOCK)
        return contextlib.nullcontext()  # S3: replace_if/delete_if are conditional requests

    @_translated
    def read_versioned(self, key: str) -> tuple[bytes, str]:
        if not self.is_s3:
            return super().read_versioned(key)
        # HEAD, then GET: if the key changes in between, the ETag is the older one and a
        # replace_if() on it fails, so a version is never paired with bytes it did not see.
        etag = str(self._head(key)["ETag"])
        return self.read_bytes(key), etag

    @_translated
    def replace_if(
        self, key: str, parts: Sequence[Buffer], expected: str | None, *, durable: bool = True
    ) -> str:
        if not self.is_s3:
            return super().replace_if(key, parts, expected, durable=durable)
        data = _plain(parts)
        bucket, name = self._split(key)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            response = self.fs.call_s3(
                "put_object", Bucket=bucket, Key=name, Body=data, **condition
            )
            return str(response["ETag"])
        except FileExistsError:  # s3fs's name for a failed If-None-Match
            pass
        except OSError as exc:
            if not (_precondition_failed(exc) or isinstance(exc, FileNotFoundError)):
                raise
        # 412 (or 404 for If-Match on a key that is gone). A retried request whose first
        # attempt went through answers 412 for our own write: identical bytes mean it was.
        try:
            current, etag = self.read_versioned(key)
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.url}/{key} is gone") from None
        if current == data:
            return etag
        raise PreconditionFailed(f"{self.url}/{key} changed")

    @_translated
    def delete_if(self, key: str, expected: str) -> None:
        if not self.is_s3:
            super().delete_if(key, expected)
            return
        bucket, name = self._split(key)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=expected)
        except FileNotFoundError:
            return
        except OSError as exc:
            if _precondition_failed(exc):
                raise PreconditionFailed(f"{self.url}/{key} changed") from None
            if _error_code(exc) not in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                raise
            # A server without conditional deletes: check, then delete (a small window).
            try:
                if str(self._head(key)["ETag"]) != expected:
                    raise PreconditionFailed(f"{self.url}/{key} changed") from None
            except FileNotFoundError:
                return
            self.delete(key)

    def _pipe(self, path: str, data: bytes, *, create: bool) -> None:
        mode = "create" if create else "overwrite"
        if self.is_s3:
            self.fs.pipe_file(path, data, mode=mode, chunksize=self.part_size)
            return
        try:
            self.fs.pipe_file(path, data, mode=mode)
        except TypeError:  # a filesystem package too old to know mode="create"
            if create and self.fs.exists(path):
                raise FileExistsError(path) from None
            self.fs.pipe_file(path, data)  # best effort: the run's lease keeps writers apart

    @_translated
    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    @_translated
    def touch(self, key: str) -> bool | None:
        """Refresh the modification time GC's grace period looks at.

        S3 has no utime: a server-side copy of the object onto itself (no bytes move
        through the client) gives it a new LastModified.
        """
        path = self._path(key)
        try:
            if self.is_s3:
                bucket, name = self._split(key)
                self.fs.call_s3(
                    "copy_object",
                    Bucket=bucket,
                    Key=name,
                    CopySource={"Bucket": bucket, "Key": name},
                    MetadataDirective="REPLACE",
                    Metadata={"stepvault-touched": f"{time.time():.3f}"},
                )
            elif self.protocol == "memory":
                with _MEMORY_LOCK:
                    self.fs.pipe_file(path, self.fs.cat_file(path))
            else:
                if not self.fs.exists(path):
                    return False  # fs.touch would create an empty file under the name
                self.fs.touch(path, truncate=False)
        except FileNotFoundError:
            return False
        except (NotImplementedError, ValueError):
            return None  # no way to refresh it here; GC's grace period uses creation time
        return True

    @_translated
    def mtime(self, key: str) -> float:
        if self.is_s3:
            return float(self._head(key)["LastModified"].timestamp())
        return float(self.fs.modified(self._path(key)).timestamp())

    @_translated
    def append(self, key: str, data: bytes) -> None:
        """Append by read-modify-write, serialised by a conditional write on S3 (If-Match).

        O(size of the key) per call: fine for small keys; the event log avoids it on
        object stores by writing one object per event.
        """
        path = self._path(key)
        for _ in range(50):
            try:
                info = self.fs.info(path)
                old = self.fs.cat_file(path)
            except FileNotFoundError:
                try:
                    self.put_atomic(key, [data], overwrite=False)
                    return
                except FileExistsError:
                    continue
            if not self.is_s3:
                with _MEMORY_LOCK:
                    self.fs.pipe_file(path, old + data)
                return
            bucket, name = self._split(key)
            try:
                self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=name, Body=old + data, IfMatch=info["ETag"]
                )
                return
            except OSError as exc:  # 412: someone appended in between; read again
                if not _precondition_failed(exc):
                    raise
                time.sleep(0.01)
        raise OSError(f"could not append to {self.url}/{key}: too much contention")

    def sync(self) -> None:
        """Nothing to flush: an acknowledged PUT is durable and visible."""


@contextlib.contextmanager
def _held(lock: Any) -> Iterator[None]:
    with lock:
        yield


def _error_code(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    response = getattr(cause, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _precondition_failed(exc: BaseException) -> bool:
    return _error_code(exc) in ("PreconditionFailed", "412")


def _s3_filesystem(protocol: str, options: dict[str, Any]) -> Any:
    import fsspec

    fs = fsspec.filesystem(protocol, **options)
    # s3fs retries some errors again around botocore's own retries: keep the product
    # bounded, so a permanent failure surfaces in about two minutes, not ten.
    fs.retries = 3
    return fs


def open_fsspec(url: str, **storage_options: Any) -> FsspecBackend:
    """A backend for an fsspec URL (``s3://bucket/prefix``, ``memory://name``, ``gs://...``).

    ``storage_options`` go to the filesystem (e.g. ``endpoint_url=``, ``key=``, ``secret=``,
    ``anon=``); credentials otherwise come from the provider's usual chain (for S3: the
    ``AWS_*`` environment variables, ``~/.aws``, instance roles; ``AWS_ENDPOINT_URL`` for
    an S3-compatible server such as MinIO). ``part_size=`` sets the multipart part size,
    ``range_size=`` the size of the concurrent ranged GETs an object larger than
    ``ranged_from=`` (default ``2 * part_size``) is read in.
    """
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency
        raise StoreNotFoundError(f"{url!r} needs fsspec: pip install fsspec") from exc
    protocol, _, rest = url.partition("://")
    options = dict(storage_options)
    part_size = int(options.pop("part_size", DEFAULT_PART_SIZE))
    range_size = int(options.pop("range_size", DEFAULT_RANGE_SIZE))
    ranged_from = options.pop("ranged_from", None)
    if protocol in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise StoreNotFoundError(
                f"{url!r}: S3 stores need s3fs; install it with pip install 'stepvault[s3]'"
            ) from None
        config = dict(DEFAULT_S3_CONFIG)
        config.update(options.pop("config_kwargs", {}) or {})
        options["config_kwargs"] = config
        # Never answer list/exists from a cache: another process may have committed since.
        options.setdefault("use_listings_cache", False)
        # Not fsspec's instance cache (shared with the user's s3fs objects): ours, fs_cache.
        options.setdefault("skip_instance_cache", True)
        if "endpoint_url" not in options:
            import os

            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["endpoint_url"] = endpoint
    try:
        if protocol in ("s3", "s3a"):
            fs = shared_filesystem(protocol, options, lambda: _s3_filesystem(protocol, options))
        else:
            fs = fsspec.filesystem(protocol, **options)
    except (ImportError, ValueError) as exc:
        raise StoreNotFoundError(
            f"{url!r}: no usable fsspec filesystem for {protocol}:// ({exc}); install its "
            "package (s3fs, gcsfs, adlfs...)"
        ) from exc
    root = rest.strip("/")
    if protocol == "memory":
        root = "/" + root
    if not root and protocol not in ("memory",):
        raise StoreNotFoundError(f"{url!r}: name a bucket (and optionally a prefix)")
    return FsspecBackend(
        fs,
        root,
        url.rstrip("/"),
        part_size=part_size,
        range_size=range_size,
        ranged_from=None if ranged_from is None else int(ranged_from),
    )
