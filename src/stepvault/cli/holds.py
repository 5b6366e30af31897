"""Reader hold commands: hold, holds, release (see :mod:`stepvault.store.reader_holds`)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from ..catalog.events import log_event
from ..catalog.refs import parse_ref, resolve_ref
from ..errors import StepvaultError
from ..store import Store
from .common import (
    JsonOpt,
    RootOpt,
    _emit_json,
    _fail,
    _root,
    _time,
    app,
    checkpoint_home,
    console,
    duration_option,
    existing_run,
)
from .output import print_table


def _ref(ref: str, store: Store, verb: str) -> tuple[str, int]:
    if verb == "hold":
        return resolve_ref(store, ref)
    run, step = parse_ref(ref)
    if not isinstance(step, int):
        raise ValueError(f"{verb} needs an exact checkpoint: RUN@STEP")
    return run, step


@app.command("hold")
def hold_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP (or RUN@latest) to hold.")],
    root: RootOpt = None,
    ttl: Annotated[str, typer.Option(help="How long: e.g. 30m, 2h, 1d.")] = "1h",
    owner: Annotated[str, typer.Option(help="Who holds it (shown in plans).")] = "cli",
    as_json: JsonOpt = False,
) -> None:
    """Hold a checkpoint for a reader: keep policies, thinning, tier eviction and GC skip it
    until `stepvault release` or the TTL runs out."""
    from ..store.reader_holds import acquire_hold
    from ..tiers.view import read_view

    try:
        store = Store.open(_root(root))
        run, step = _ref(ref, read_view(store), "hold")  # RUN@latest: in any tier
        home, _ = checkpoint_home(store, run, step)  # an archived one: held in its tier
        held = acquire_hold(
            home, run, step, ttl=duration_option("--ttl", ttl), owner=owner, tie_to_process=False
        )
        log_event(store, run, "hold", step=step, owner=owner, token=held.record.token)
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(held.record.to_json())
    console.print(
        f"held {run}@{step} for {owner} until {_time(held.record.expires)} "
        f"(token {held.record.token[:12]}; release: stepvault release {run}@{step} "
        f"--token {held.record.token[:12]})",
        highlight=False,
    )
    return None


@app.command("holds")
def holds_cmd(
    run: Annotated[str | None, typer.Argument(help="Only this run's holds.")] = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Live reader holds (expired ones are not shown, and are cleaned up)."""
    from ..store.reader_holds import held_runs, live_holds

    try:
        store = Store.open(_root(root))
        runs = [existing_run(store, run)] if run is not None else held_runs(store)
        rows = [h for r in runs for hs in live_holds(store, r).values() for h in hs]
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    rows.sort(key=lambda h: (h.run, h.step, h.created))
    if as_json:
        return _emit_json([h.to_json() for h in rows])
    if not rows:
        console.print("no live reader holds", highlight=False)
        return None
    table = Table("checkpoint", "owner", "where", "since", "expires", "token", title="reader holds")
    now = time.time()
    for h in rows:
        where = f"pid {h.pid}@{h.host}" if h.pid is not None else h.host
        left = f"{_time(h.expires)} ({(h.expires - now) / 60:.0f} min)"
        table.add_row(f"{h.run}@{h.step}", h.owner, where, _time(h.created), left, h.token[:12])
    print_table(table)
    return None


@app.command("release")
def release_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP whose holds to release.")],
    root: RootOpt = None,
    token: Annotated[str | None, typer.Option(help="Only the hold with this token.")] = None,
    owner: Annotated[str | None, typer.Option(help="Only the holds of this owner.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Release reader holds on a checkpoint (all of them, or by --token / --owner)."""
    from ..store.reader_holds import release_holds

    try:
        store = Store.open(_root(root))
        run, step = _ref(ref, store, "release")
        try:
            home, _ = checkpoint_home(store, run, step)  # an archived one: its tier's holds
        except StepvaultError:
            home = store  # gone everywhere: its holds in hot can still be released
        released = release_holds(home, run, step, token=token, owner=owner)
        if not released:
            raise ValueError(f"no reader hold on {run}@{step} matches; see stepvault holds {run}")
        log_event(store, run, "release", step=step, holds=len(released))
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({"run": run, "step": step, "released": len(released)})
    console.print(f"released {len(released)} hold(s) on {run}@{step}", highlight=False)
    return None
