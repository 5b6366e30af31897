"""One S3 filesystem per process and configuration, shared by every store opened on it.

Creating an ``s3fs.S3FileSystem`` builds a botocore session and client and, on its first
request, a connection pool: about 0.1 s, more than restoring a 134 MB checkpoint from a
local S3 server takes after it (measured in BENCHMARKS.md, "Restore at the storage limit").
``stepvault.restore(url)``, the CLI and the dashboard open the store anew on every call, so
they paid it every time.

fsspec's own instance cache is not used for this (``skip_instance_cache=True``): it would
share our instance with the user's own ``s3fs`` objects of the same options, and we change
ours (``retries``). So this module keeps its own, emptied in a forked child (a DataLoader
worker never uses its parent's connections) and keyed by

* the URL's protocol and the storage options, as fsspec tokenizes them;
* every ``AWS_*`` environment variable: credentials, profile, region and endpoint come from
  there, and a process that changes them (new credentials after a failure) gets a client
  that reads the new ones, as it did when every open made one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_filesystems: dict[tuple[Any, ...], Any] = {}


def _key(protocol: str, options: dict[str, Any]) -> tuple[Any, ...]:
    from fsspec.utils import tokenize

    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    return (protocol, tokenize(options), env)


def shared_filesystem(protocol: str, options: dict[str, Any], make: Callable[[], Any]) -> Any:
    """The filesystem ``make()`` returns for ``protocol`` and ``options``, made once per
    process and ``AWS_*`` environment and shared from then on (thread-safe)."""
    key = _key(protocol, options)
    with _lock:
        fs = _filesystems.get(key)
        if fs is None:
            fs = _filesystems[key] = make()
        return fs


def clear() -> None:
    """Forget every shared filesystem: the next store opened makes a new client."""
    with _lock:
        _filesystems.clear()


def _forked() -> None:
    # A new lock too: another thread of the parent may have held this one at the fork.
    global _lock
    _lock = threading.Lock()
    _filesystems.clear()


os.register_at_fork(after_in_child=_forked)
