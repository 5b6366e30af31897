"""Progress bars on a terminal (rich), shared by the CLI and by restores from slow tiers.

Operations take ``progress(done, total)`` callbacks and know nothing of terminals; these
helpers draw one on stderr, and give None when stderr is not a terminal, so scripts and
logs stay clean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

#: ``progress(done, total)``: what an operation reports; total None while unknown.
ProgressFn = Callable[[int, "int | None"], None]


def progress_columns(unit: str = "bytes") -> list[ProgressColumn]:
    """Description, bar, percentage, amount (bytes with rate, or items) and ETA."""
    amount: list[ProgressColumn] = (
        [MofNCompleteColumn()]
        if unit == "items"
        else [DownloadColumn(binary_units=True), TransferSpeedColumn()]
    )
    return [
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        *amount,
        TimeRemainingColumn(),
    ]


@contextmanager
def terminal_bar(description: str, console: Console | None = None) -> Iterator[ProgressFn | None]:
    """One bar on stderr while the block runs; None when stderr is not a terminal."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    with Progress(*progress_columns(), console=console, transient=False) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        yield update
