"""``stepvault ui``: the web dashboard (needs ``pip install 'stepvault[ui]'``)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ..errors import StepvaultError
from .common import RootOpt, _fail, _root, app, console


@app.command("ui")
def ui_cmd(
    root: RootOpt = None,
    host: Annotated[
        str,
        typer.Option(help="Address to listen on; anything but loopback needs --token."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=0, max=65535)] = 8765,
    token: Annotated[
        str | None,
        typer.Option(
            help="Secret every request must carry (default: $STEPVAULT_UI_TOKEN); required "
            "for a non-loopback --host.",
        ),
    ] = None,
    allow_actions: Annotated[
        bool,
        typer.Option(
            "--allow-actions",
            help="Enable pin/unpin, annotate, promote/rollback and the gc preview (each "
            "confirmed, and written to the event log). Without it nothing is ever written.",
        ),
    ] = False,
    refresh: Annotated[
        float, typer.Option(help="Seconds between live-refresh polls of an open page (0: off).")
    ] = 2.0,
) -> None:
    """Web dashboard over the store: runs, metric curves and timelines, checkpoints, the
    registry and the event log, refreshed live while a run trains. Read-only by default."""
    try:
        from ..ui import UnsafeBindError, serve
    except ImportError as exc:
        return _fail(
            RuntimeError(
                f"stepvault ui needs the optional web stack ({exc.name or exc} is missing): "
                "pip install 'stepvault[ui]'"
            )
        )
    token = token or os.environ.get("STEPVAULT_UI_TOKEN") or None
    try:
        serve(
            _root(root),
            host=host,
            port=port,
            token=token,
            allow_actions=allow_actions,
            refresh_seconds=refresh,
            announce=lambda line: console.print(line, highlight=False, soft_wrap=True),
        )
    except (StepvaultError, UnsafeBindError, OSError) as exc:
        return _fail(exc)
    return None
