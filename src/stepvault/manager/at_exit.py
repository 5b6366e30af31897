"""A local manager still open when the interpreter exits is closed first, as ``with`` would.

A script that ends (or raises) without ``mgr.close()`` used to lose the asynchronous save
in flight without a word: at exit ``concurrent.futures`` refuses new work on every thread
pool before the interpreter joins the threads, so the background save failed as it started
its writers ("cannot schedule new futures after interpreter shutdown"), logged only as a
``save_failed`` event, and left the run's lease behind.

``threading._register_atexit`` callbacks run at the start of the interpreter's shutdown, the
last registered first: registered after ``concurrent.futures`` (imported before any manager
exists), this one closes the open managers while their pools still take work. It is the
hook ``concurrent.futures`` itself uses. A manager of a process group is not closed here:
its close is collective, and a rank that exits alone would wait for the others. Nor is one
in a forked child (a DataLoader worker runs the same hook when it ends): it would release
its parent's lease.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

#: weakly: a manager nobody refers to any more is freed with its staging memory as before
#: (a script's ``mgr``, or one in the frames of the exception that ends it, is still here)
_open: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.Lock()
_registered = False
#: the process whose managers these are: a forked child (a DataLoader worker) runs the
#: same exit hook when it ends, and must not close its parent's manager (and its lease)
_pid = os.getpid()


def track(manager: Any) -> None:
    """Close ``manager`` at interpreter exit unless it is closed before (:func:`forget`)."""
    global _registered
    with _lock:
        _open[id(manager)] = manager
        if _registered:
            return
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # pragma: no cover - CPython has had it since 3.9
            return
        try:
            register(_close_open)
        except RuntimeError:  # already shutting down
            return
        _registered = True


def forget(manager: Any) -> None:
    """``manager`` was closed: nothing to do for it at exit."""
    with _lock:
        _open.pop(id(manager), None)


def _close_open() -> None:
    if os.getpid() != _pid:
        return  # a forked child ending: its parent's managers are not its to close
    with _lock:
        managers = list(_open.values())
    for manager in managers:
        try:
            manager.close()
        except BaseException as exc:  # nobody is left to catch it: say it
            sys.stderr.write(
                f"stepvault: run {manager.run!r}: closing the manager at exit (it was not "
                f"closed) failed: {type(exc).__name__}: {exc}\n"
            )


def _forked() -> None:
    global _lock, _pid
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _open.clear()
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
