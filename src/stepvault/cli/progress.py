"""Progress bars for long commands (``verify --deep``, ``export``, ``tier``, ``gc``).

Operations take an optional ``progress(done, total)`` callback (bytes, or items for
``unit="items"``; ``total`` None while unknown) and know nothing of the terminal; the
commands get one from :func:`progress_bars`, drawn on stderr with rich (bytes, rate, ETA),
and a no-op when stderr is not a terminal or the command prints ``--json``, so scripts and
logs stay clean.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import Progress

from .._progress import ProgressFn, progress_columns
from .common import err_console


def _no_progress(done: int, total: int | None) -> None:
    return None


class Bars:
    """Tasks of one progress display; :meth:`task` hands out ``progress`` callbacks."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress

    @property
    def enabled(self) -> bool:
        return self._progress is not None

    def task(self, description: str) -> ProgressFn:
        """A new bar; the returned callback moves it (``done`` is cumulative)."""
        if self._progress is None:
            return _no_progress
        progress = self._progress
        task_id = progress.add_task(description, total=None)

        def update(done: int, total: int | None) -> None:
            progress.update(task_id, completed=done, total=total)

        return update


@contextmanager
def progress_bars(*, as_json: bool = False, unit: str = "bytes") -> Iterator[Bars]:
    """Progress bars on stderr while the block runs; disabled (no-op callbacks) when
    stderr is not a terminal or the output is ``--json``."""
    if as_json or not err_console.is_terminal:
        yield Bars(None)
        return
    progress = Progress(*progress_columns(unit), console=err_console, transient=False)
    with progress:
        yield Bars(progress)
