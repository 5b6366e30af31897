"""Shared pieces of the ``stepvault`` command line: the Typer app, options and output helpers.

Command groups live in their own modules (``cli/<topic>.py``) and register on :data:`app`;
``cli/main.py`` imports them all.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .._units import format_time, parse_duration
from .._units import human_bytes as human_bytes  # the commands import it from here
from ..errors import CheckpointNotFoundError, StepvaultError

if TYPE_CHECKING:
    from ..store import Store

#: Typer's (Click's) usage error: a bad option value, a missing argument, an unknown command.
_UsageError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)


def _one_line(exc: BaseException) -> str:
    """An error as one line: ``OSError`` as "PATH: reason", others as their message."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, StepvaultError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror.lower()}"
    usage = isinstance(exc, _UsageError)
    text = exc.format_message() if usage else str(exc)  # type: ignore[attr-defined]
    return " ".join(text.split()) or type(exc).__name__


class StepvaultGroup(TyperGroup):
    """The command group: every command's user errors end as one line and exit 2.

    A command reports what it expects (``_fail``); this is the net under all of them: a
    usage error (bad option value, missing argument), a :class:`StepvaultError`, an
    ``OSError`` (unwritable output, a file where a folder belongs) or a ``ValueError``
    (a rule refusing its arguments) that escapes a command prints ``error: ...`` on one
    line and exits 2 instead of a traceback. ``STEPVAULT_DEBUG=1`` lets them through.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (_UsageError, StepvaultError, OSError, ValueError) as exc:
            if os.environ.get("STEPVAULT_DEBUG") or type(exc).__name__ == "NoArgsIsHelpError":
                raise
            if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
                raise  # the reader of a pipe went away: typer exits quietly
            hint = ""
            if isinstance(exc, _UsageError) and getattr(exc, "ctx", None) is not None:
                hint = f" (see: {exc.ctx.command_path} --help)"  # type: ignore[attr-defined]
            _fail_text(_one_line(exc) + hint)


app = typer.Typer(
    help="stepvault: content-addressed, verified, pickle-free training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=StepvaultGroup,
)
console = Console(soft_wrap=True)  # a long line stays one line: whole in a pipe
err_console = Console(stderr=True, soft_wrap=True)  # an error is one line

RootOpt = Annotated[
    str | None,
    typer.Option("--root", "-r", help="Store location (default: the global --root)."),
]
_GLOBAL = {"root": "."}


@app.callback()
def _global_options(
    root: Annotated[
        str,
        typer.Option(
            "--root", "-r", envvar="STEPVAULT_ROOT", help="Store location (or $STEPVAULT_ROOT)."
        ),
    ] = ".",
) -> None:
    """stepvault: content-addressed, verified, pickle-free training checkpoints."""
    _GLOBAL["root"] = root


def _ops() -> Any:
    """The :mod:`stepvault.ops` package, imported on first use: it imports torch (~2.5 s),
    which commands that only read JSON (``ls``, ``show``) should not pay for."""
    from .. import ops

    return ops


def _root(root: str | None) -> str:
    """The store location a command uses (its ``--root``, else the global one); a path
    that names a file, not a store directory, is a usage error (exit 2)."""
    path = root if root is not None else _GLOBAL["root"]
    if "://" not in path and os.path.exists(path) and not os.path.isdir(path):
        _fail_text(
            f"--root {path!r} is a file, not a store: give the directory that holds "
            "stepvault.json (or set $STEPVAULT_ROOT)"
        )
    return path


def existing_run(store: Store, run: str, *, also: Iterable[str] = ()) -> str:
    """``run`` when ``store`` (or ``also``: runs known elsewhere, e.g. on a cold tier or in
    node memory) has it; otherwise a :class:`CheckpointNotFoundError` naming the nearest run
    names (difflib) or, when none is close, the runs there are.

    For commands that take a run name: a typo must not read as an empty run.
    """
    runs = sorted(set(store.list_runs()) | set(also))
    return existing_name("run", run, runs, store.backend.url, "stepvault ls")


def checkpoint_home(store: Store, run: str, step: int) -> tuple[Store, str | None]:
    """The store that holds ``run@step`` and the tier's name: the hot store itself (None),
    or, for a checkpoint moved off hot (``tier --evict``), the first cold tier holding it,
    where a pin, a hold or an attachment must go to protect or describe it. Otherwise a
    :class:`CheckpointNotFoundError` naming the run's steps in every tier."""
    from ..tiers.view import TieredView, read_view

    if store.backend.exists(store.manifest_key(run, step)):
        return store, None
    view = read_view(store)
    if isinstance(view, TieredView):
        for name in view.where(run, step):
            return view.tiers.get(name, create=False), name
    existing_run(view, run)  # a typo: the nearest run names
    raise CheckpointNotFoundError(  # the steps of every tier (a view lists them all)
        f"no committed checkpoint {run}@{step} in {store.backend.url}{view.steps_hint(run, step)}"
    )


def existing_name(kind: str, name: str, names: Iterable[str], where: str, listing: str) -> str:
    """``name`` when it is one of ``names``; otherwise a :class:`CheckpointNotFoundError`
    "no <kind> 'name' in <where>" with the nearest names, or the names there are, and the
    command that lists them all."""
    known = sorted(set(names))
    if name in known:
        return name
    head = f"no {kind} {name!r} in {where}"
    if not known:
        raise CheckpointNotFoundError(f"{head}: it holds no {kind}s yet")
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if near:
        shown = " or ".join(repr(n) for n in near)
        raise CheckpointNotFoundError(f"{head}; did you mean {shown}? (all: {listing})")
    shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    raise CheckpointNotFoundError(f"{head}; {kind}s: {shown} (all: {listing})")


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


_time = format_time  # the commands' name for it (stepvault._units)


def duration_option(option: str, text: str) -> float:
    """Seconds in a duration option (``90s``, ``30m``, ``12h``, ``7d``, ``2w``; see
    :func:`stepvault._units.parse_duration`); a usage error naming ``option`` otherwise."""
    try:
        return parse_duration(option, text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fail_text(text: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(' '.join(text.split()))}", highlight=False)
    raise typer.Exit(2)


def _fail(exc: Exception) -> None:
    """Print ``error: <exc>`` as one line on stderr and exit 2 (a usage error), or exit 1
    with the way out when the store's data is damaged (an ``IntegrityError``: what
    ``verify`` exits 1 for), so scripts tell damage from a typo."""
    from ..errors import IntegrityError

    if isinstance(exc, IntegrityError):
        text = _one_line(exc)
        err_console.print(
            f"[bold red]error:[/] {escape(text)}; find every damaged checkpoint with "
            "'stepvault verify --deep', take them out of use with 'stepvault repair'",
            highlight=False,
        )
        raise typer.Exit(1)
    _fail_text(_one_line(exc))
