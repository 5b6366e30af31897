"""``stepvault ls RUN`` at scale: pick the page of checkpoints to show, then draw it.

Drawing a rich Table of 10,000 rows took ~8 s, so a long listing is shown as the newest
``--limit`` rows (default :data:`DEFAULT_LIMIT`; ``--limit 0`` for all), optionally only
from ``--since`` (a step, or a duration such as ``2h``), and only the manifests of the rows
shown are read. A table is drawn only on a terminal and for at most :data:`TABLE_MAX` rows;
otherwise (a pipe, or thousands of rows) each checkpoint is one plain aligned line, written
in one go, which is as fast as ``--json``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from .._units import parse_duration
from ..errors import StepvaultError
from .common import _emit_json, _time, console, err_console, human_bytes
from .light import light_mark
from .output import print_table

#: Rows shown by default (the newest); ``--limit 0`` shows every checkpoint.
DEFAULT_LIMIT = 50
#: Above this many rows, plain lines are printed even on a terminal (a Table is slow).
TABLE_MAX = 200


def parse_since(text: str | None) -> tuple[int | None, float | None]:
    """``--since``: ``"1200"`` -> (step 1200, None); ``"2h"`` -> (None, seconds 7200)."""
    if text is None:
        return None, None
    text = text.strip()
    if text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text), None
    try:
        return None, parse_duration("--since", text)
    except ValueError:
        raise ValueError(
            f"bad --since {text!r}: a step (e.g. 1200) or a duration (90s, 30m, 12h, 7d)"
        ) from None


def select_steps(
    steps: Sequence[int], *, limit: int | None, since_step: int | None
) -> tuple[list[int], int]:
    """The steps to read (the newest ``limit`` from ``since_step`` on) and how many match."""
    chosen = [s for s in steps if since_step is None or s >= since_step]
    matching = len(chosen)
    if limit:
        chosen = chosen[-limit:]
    return chosen, matching


def list_checkpoints(
    vault: Any, run: str, *, limit: int | None, since: str | None, as_json: bool
) -> None:
    """Print the checkpoints of ``run`` (see the module docstring for what is shown)."""
    since_step, since_seconds = parse_since(since)
    if limit is None:
        limit = 0 if as_json else DEFAULT_LIMIT  # scripts get everything unless they ask
    if limit < 0:
        raise ValueError("--limit must be 0 (all) or a positive number of checkpoints")
    steps = vault.steps(run)
    if since_seconds is None:
        chosen, matching = select_steps(steps, limit=limit, since_step=since_step)
        partial = len(chosen) != len(steps)
        summaries = vault.checkpoints(run, chosen) if partial else vault.checkpoints(run)
    else:  # a time window needs every checkpoint's time: read them all (cached summaries)
        cutoff = time.time() - since_seconds
        summaries = [s for s in vault.checkpoints(run) if s.error or s.created >= cutoff]
        matching = len(summaries)
        summaries = summaries[-limit:] if limit else summaries
    damage = known_damage(vault.store, run)
    if damage:  # a restore found these damaged: say so, as a damaged manifest is
        summaries = [_mark(s, damage[s.step]) if s.step in damage else s for s in summaries]
    if as_json:
        return _emit_json([s.__dict__ for s in summaries])
    if console.is_terminal and len(summaries) <= TABLE_MAX:
        _table(run, summaries)
    else:
        _plain(summaries)
    if len(summaries) < matching:
        err_console.print(
            f"[dim]newest {len(summaries)} of {matching} checkpoints shown "
            "(--limit 0 for all, --since STEP|DURATION to start later)[/]",
            highlight=False,
        )
    return None


def known_damage(store: Any, run: str) -> dict[int, str]:
    """Steps of ``run`` that a restore passed over as damaged (its event log's ``skipped``),
    with the reason, unless the step was committed again or deleted since."""
    from ..catalog.events import read_events

    damaged: dict[int, str] = {}
    try:
        events = read_events(store, run)
    except (StepvaultError, OSError):
        return damaged
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("event") == "restore":
            for k in e.get("skipped") or []:
                if isinstance(k, dict) and isinstance(k.get("step"), int):
                    damaged[k["step"]] = f"a restore skipped it: {k.get('reason', '?')}"
        elif e.get("event") in ("save", "delete", "repair") and isinstance(e.get("step"), int):
            damaged.pop(e["step"], None)
    return damaged


def _mark(s: Any, reason: str) -> Any:
    return dataclasses.replace(s, valid=False, error=reason)


def _metrics(s: Any) -> str:
    return light_mark(s) + " ".join(f"{k}={v:.4g}" for k, v in s.metrics.items())


def _table(run: str, summaries: list[Any]) -> None:
    table = Table(
        "step", "epoch", "time", "logical", "stored", "new", "metrics", title=f"run {run}"
    )
    for s in summaries:
        if s.error:
            table.add_row(str(s.step), "", "", "", "", "", f"[red]DAMAGED: {s.error}[/]")
            continue
        table.add_row(
            str(s.step),
            "" if s.epoch is None else str(s.epoch),
            _time(s.created),
            human_bytes(s.logical_bytes),
            human_bytes(s.stored_bytes),
            human_bytes(s.new_bytes),
            _metrics(s),
        )
    print_table(table)


def _plain(summaries: list[Any]) -> None:
    width = max([4, *(len(str(s.step)) for s in summaries)])
    lines = [
        f"{'step':>{width}}  {'epoch':>5}  {'time':<19}  {'logical':>10}  {'stored':>10}  "
        f"{'new':>10}  metrics"
    ]
    for s in summaries:
        if s.error:
            lines.append(f"{s.step:>{width}}  DAMAGED: {s.error}")
            continue
        epoch = "" if s.epoch is None else str(s.epoch)
        lines.append(
            f"{s.step:>{width}}  {epoch:>5}  {_time(s.created):<19}  "
            f"{human_bytes(s.logical_bytes):>10}  {human_bytes(s.stored_bytes):>10}  "
            f"{human_bytes(s.new_bytes):>10}  {_metrics(s)}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
