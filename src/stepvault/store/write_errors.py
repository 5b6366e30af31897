"""What a failed write on a local disk says: the store and the way out, as a StepvaultError.

A bare ``PermissionError: [Errno 13] Permission denied`` (``os.utime`` names no file) told a
user saving into a read-only store neither which store nor what to do; a full device the
same. Every write of :class:`~.local.LocalBackend` goes through :func:`writes`, which turns
those two into :class:`~stepvault.errors.ReadOnlyError` and
:class:`~stepvault.errors.OutOfSpaceError` (still ``OSError`` subclasses with the same
``errno``, so callers that catch ``OSError`` are unchanged).
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import OutOfSpaceError, ReadOnlyError

NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}

F = TypeVar("F", bound=Callable[..., Any])


def typed(exc: OSError, url: str, key: str) -> OSError:
    """``exc`` as the error a user can act on (itself when it is neither case)."""
    if isinstance(exc, OutOfSpaceError | ReadOnlyError):
        return exc
    if exc.errno in NO_SPACE:
        return OutOfSpaceError(
            exc.errno,
            f"no space left on {url} while writing {key}; nothing new was committed and "
            "earlier checkpoints are intact. Free space (e.g. 'stepvault gc') or save to "
            "another store.",
        )
    if exc.errno in NOT_WRITABLE:
        return ReadOnlyError(
            exc.errno,
            f"the store {url} is not writable by this process ({exc.strerror} writing "
            f"{key}); nothing new was committed. Reading it works (restore, load, ls); to "
            "save, fix its permissions or mount, or save to another store.",
        )
    return exc


def writes(method: F) -> F:
    """Decorate a backend write method ``(self, key, ...)``: see the module docstring."""

    @functools.wraps(method)
    def wrapper(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, key, *args, **kwargs)
        except OSError as exc:
            better = typed(exc, self.url, key if isinstance(key, str) else "its objects")
            if better is exc:
                raise
            raise better from exc

    return wrapper  # type: ignore[return-value]
