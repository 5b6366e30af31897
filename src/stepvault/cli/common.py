"""Shared pieces of the ``stepvault`` command line: the Typer app, options and output helpers.

Command groups live in their own modules (``cli/<topic>.py``) and register on :data:`app`;
``cli/main.py`` imports them all.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from .._units import format_time, parse_duration
from .._units import human_bytes as human_bytes  # the commands import it from here

app = typer.Typer(
    help="stepvault: content-addressed, verified, pickle-free training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    return root if root is not None else _GLOBAL["root"]


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


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
    raise typer.Exit(2)
