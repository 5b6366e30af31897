"""``stepvault tier`` and ``stepvault tiers ...``: move checkpoints between storage tiers and
see what lives where."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import StepvaultError
from .common import (
    JsonOpt,
    RootOpt,
    _emit_json,
    _fail,
    _root,
    app,
    console,
    duration_option,
    existing_run,
    human_bytes,
)
from .output import print_table
from .progress import progress_bars

tiers_app = typer.Typer(
    help="Storage tiers: list what lives where, add or remove cold tiers, usage per tier.",
    no_args_is_help=True,
)
app.add_typer(tiers_app, name="tiers")


@app.command("tier")
def tier_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP, RUN@latest, or RUN (all its hot steps).")],
    to: Annotated[str, typer.Option("--to", help="Cold tier name (see 'stepvault tiers ls').")],
    evict: Annotated[
        bool,
        typer.Option("--evict", help="Then remove it from hot (only once committed in COLD)."),
    ] = False,
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than",
            help="Only checkpoints saved longer ago than this (90s, 30m, 6h, 2d): "
            "MoveAfter for a run that no longer saves (e.g. from cron).",
        ),
    ] = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy checkpoints from the hot store to cold tier TO (objects it lacks, verified, then
    the manifest); with --evict, then delete the hot copy (GC reclaims its objects)."""
    from ..catalog.events import log_event
    from ..catalog.refs import latest_step, parse_ref
    from ..store import Store
    from ..store.lease import acquire_lease
    from ..tiers.config import Tiers
    from ..tiers.copy import copy_checkpoint, copy_pin
    from ..tiers.mover import protected_steps

    try:
        hot = Store.open(_root(root))
        tiers = Tiers.of(hot)
        if to == "hot":
            rows = _to_hot(hot, tiers, ref, evict=evict, as_json=as_json)
            return _emit_json(rows) if as_json else _print_rows(rows)
        target = tiers[to]
        run, step = parse_ref(ref)
        steps = hot.list_steps(run)
        if step == "latest":
            steps = [latest_step(hot, run, steps)]
        elif isinstance(step, int):  # parse_ref gives an int, "latest" or None
            steps = [step]
        if older_than is not None:
            cutoff = time.time() - duration_option("--older-than", older_than)
            steps = _saved_before(hot, run, steps, cutoff)
            if not steps:
                raise StepvaultError(
                    f"run {run!r} has no checkpoint in the hot store older than {older_than}"
                )
        if not steps:
            raise StepvaultError(
                f"run {run!r} has no checkpoint in the hot store {hot.backend.url}"
            )
        protected = protected_steps(hot, run)
        rows = []
        lease = acquire_lease(hot, run) if evict else None
        try:
            # Read under the lease: what must stay in hot, as the mover's plan keeps it.
            stays = _stays_in_hot(hot, run, protected) if evict else {}
            for s in steps:
                with progress_bars(as_json=as_json) as bars:
                    stats = copy_checkpoint(
                        hot,
                        target,
                        run,
                        s,
                        codec=tiers.spec(to).codec,
                        progress=bars.task(f"{run}@{s} -> {to}"),
                    )
                if s in protected:
                    copy_pin(hot, target, run, s)
                log_event(hot, run, "tier_copy", step=s, tier=to, bytes=stats.bytes_written)
                evicted = False
                kept = stays.get(s) if evict else None
                if evict and kept is None and target.backend.exists(Store.manifest_key(run, s)):
                    hot.delete_manifest(run, s)
                    log_event(hot, run, "tier_evict", step=s, kept_in=[to], by="cli")
                    evicted = True
                rows.append({**stats.to_json(), "tier": to, "evicted": evicted, "kept": kept})
        finally:
            if lease is not None:
                lease.release()
    except StepvaultError as exc:
        return _fail(exc)
    except OSError as exc:
        return _fail(StepvaultError(f"storage error while moving to {to!r}: {exc}"))
    if as_json:
        return _emit_json(rows)
    return _print_rows(rows)


def _to_hot(hot: Any, tiers: Any, ref: str, *, evict: bool, as_json: bool) -> list[dict]:
    """``tier RUN[@STEP] --to hot``: copy archived checkpoints back into hot (verified, as
    every tier copy), e.g. before a restart that should restore at local-disk speed; RUN
    alone: every step only cold tiers hold. Cold tiers are archives: nothing leaves them."""
    from ..catalog.events import log_event
    from ..catalog.refs import parse_ref
    from ..tiers.copy import copy_checkpoint
    from ..tiers.view import TieredView

    if evict:
        raise StepvaultError("--evict with --to hot: nothing is deleted from a cold tier")
    view = TieredView(tiers)
    run, step = parse_ref(ref)
    if step == "latest":
        steps = view.list_steps(run)[-1:]
    elif isinstance(step, int):
        steps = [step]
    else:
        steps = sorted(set(view.list_steps(run)) - set(hot.list_steps(run)))
    rows = []
    in_hot = set(hot.list_steps(run))
    for s in steps:
        source = next((n for n in view.where(run, s) if n != "hot"), None)
        if s in in_hot or source is None:
            held = "in hot already" if s in in_hot else "in no tier"
            raise StepvaultError(f"{run}@{s} is {held}: nothing to copy to hot")
        with progress_bars(as_json=as_json) as bars:
            stats = copy_checkpoint(
                tiers[source], hot, run, s, progress=bars.task(f"{run}@{s} {source} -> hot")
            )
        log_event(hot, run, "tier_copy", step=s, tier="hot", source=source)
        rows.append({**stats.to_json(), "tier": "hot", "evicted": False, "kept": None})
    if not rows:
        raise StepvaultError(f"run {run!r} has no checkpoint outside hot: nothing to copy")
    return rows


def _print_rows(rows: list[dict]) -> None:
    table = Table("step", "objects", "copied", "reused", "bytes written", "seconds", "hot copy")
    for r in rows:
        table.add_row(
            str(r["step"]),
            str(r["objects"]),
            str(r["copied_objects"]),
            str(r["reused_objects"]),
            human_bytes(r["bytes_written"]),
            f"{r['seconds']:.2f}",
            "evicted" if r["evicted"] else f"kept: {r['kept']}" if r["kept"] else "kept",
        )
    print_table(table)
    return None


def _stays_in_hot(hot: Any, run: str, protected: set[int]) -> dict[int, str]:
    """Steps ``--evict`` leaves in hot, with why: the rules the mover's plan obeys
    (STORAGE.md, "Tier policies"): the newest valid full checkpoint (a restart needs it
    fast), pinned and registry-held ones, and those a reader holds (it may be reading)."""
    from ..catalog import checkpoint_records
    from ..store.reader_holds import live_holds

    out: dict[int, str] = {}
    full = [r.step for r in checkpoint_records(hot, run) if r.valid and r.kind == "full"]
    if full:
        out[full[-1]] = "newest valid checkpoint (a restart needs it)"
    pins = set(hot.pinned_steps(run))
    for step in protected:
        out[step] = "pinned (unpin to move it)" if step in pins else "held by the model registry"
    for step, holds in live_holds(hot, run, clean=False).items():
        owners = ", ".join(sorted({h.owner or "?" for h in holds}))
        out[step] = f"held by reader {owners} (stepvault release)"
    return out


def _saved_before(hot: Any, run: str, steps: list[int], cutoff: float) -> list[int]:
    from ..format import parse_manifest

    out = []
    for s in steps:
        try:
            created = parse_manifest(hot.read_manifest(run, s), f"{run}@{s}").created
        except StepvaultError:
            continue  # a damaged checkpoint is never copied (the copy would refuse it too)
        if created <= cutoff:
            out.append(s)
    return out


@tiers_app.command("ls")
def tiers_ls(
    run: Annotated[str | None, typer.Argument(help="Only this run.")] = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
    mem_root: Annotated[
        str | None, typer.Option("--mem-root", help="The mem tier's tmpfs root.")
    ] = None,
) -> None:
    """What lives where: each checkpoint with the tiers holding it (hot first), and what
    node memory the mem tier holds."""
    from ..store import Store
    from ..tiers.config import Tiers
    from ..tiers.view import TieredView, catalog
    from .mem import mem_usage, print_mem_usage

    try:
        tiers = Tiers.of(Store.open(_root(root)))
        entries = catalog(tiers, run)
        mem = [m for m in mem_usage(tiers.hot, mem_root) if run is None or m["run"] == run]
        if run is not None and not entries and not mem:
            # a typo must not read as a run with nothing anywhere: name the runs there are
            known = set(TieredView(tiers).list_runs())
            existing_run(
                tiers.hot, run, also=known | {m["run"] for m in mem_usage(tiers.hot, mem_root)}
            )
    except StepvaultError as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(
            {
                "tiers": [{"name": "hot", "url": tiers.hot.backend.url}]
                + [{"name": s.name, "url": s.url, "codec": s.codec} for s in tiers.specs.values()],
                "checkpoints": [e.to_json() for e in entries],
                "mem": mem,
            }
        )
    print_mem_usage(mem)
    info = Table("tier", "location", "codec", title="tiers")
    info.add_row("hot", tiers.hot.backend.url, str(tiers.hot.settings.get("codec", "raw")))
    for s in tiers.specs.values():
        info.add_row(s.name, s.url, s.codec)
    print_table(info)
    table = Table("run", "step", *tiers.names, title="checkpoints by tier")
    for e in entries:
        table.add_row(e.run, str(e.step), *("●" if t in e.tiers else "" for t in tiers.names))
    print_table(table)
    return None


@tiers_app.command("add")
def tiers_add(
    name: Annotated[str, typer.Argument(help="Tier name, e.g. 'archive'.")],
    url: Annotated[str, typer.Argument(help="Store location: s3://bucket/prefix, a path...")],
    codec: Annotated[
        str,
        typer.Option(
            help="'keep' (copy as stored), a codec to re-encode (auto, zstd...) or "
            "'xor'/'xor:K' (lossless deltas, a full object every K)"
        ),
    ] = "keep",
    endpoint_url: Annotated[
        str | None, typer.Option(help="S3-compatible endpoint (MinIO, ...).")
    ] = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add (or replace) cold tier NAME at URL. Credentials come from the environment."""
    from ..store import Store
    from ..tiers.config import Tiers, TierSpec, add_tier

    try:
        hot = Store.open(_root(root))
        options = {"endpoint_url": endpoint_url} if endpoint_url else {}
        add_tier(hot, TierSpec(name, url, codec, options))
        Tiers.of(hot)[name]  # reachable, and initialised as a store
    except StepvaultError as exc:
        return _fail(exc)
    except OSError as exc:
        return _fail(StepvaultError(f"tier {name!r} was recorded but {url} is unreachable: {exc}"))
    if as_json:
        return _emit_json({"name": name, "url": url, "codec": codec})
    console.print(f"tier {name} -> {url} (codec {codec})", highlight=False)
    return None


@tiers_app.command("remove")
def tiers_remove(
    name: Annotated[str, typer.Argument(help="Tier to forget (its contents are not touched).")],
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Forget cold tier NAME; the checkpoints stored there are left as they are."""
    from ..store import Store
    from ..tiers.config import remove_tier

    try:
        remove_tier(Store.open(_root(root)), name)
    except StepvaultError as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({"name": name, "removed": True})
    console.print(f"tier {name} removed from the configuration", highlight=False)
    return None


def print_usage_by_tier(root: str, as_json: bool) -> None:
    """Body of ``stepvault tiers du`` (and ``stepvault du --by-tier``)."""
    from ..ops.usage import usage_of_reachable_tiers
    from ..store import Store

    try:
        by_tier, failed = usage_of_reachable_tiers(Store.open(root))
    except StepvaultError as exc:
        return _fail(exc)
    if as_json:
        doc = {name: u.to_json() for name, u in by_tier.items()}
        _emit_json({**doc, **{name: {"unreachable": why} for name, why in failed.items()}})
        if failed:
            raise typer.Exit(1)
        return None
    table = Table(
        "tier",
        "checkpoints",
        "logical",
        "stored (dedup)",
        "objects",
        "unreferenced",
        title="usage by tier",
    )
    for name, u in by_tier.items():
        table.add_row(
            name,
            str(u.checkpoints),
            human_bytes(u.logical_bytes),
            human_bytes(u.stored_bytes),
            str(u.objects),
            human_bytes(u.unreferenced_bytes),
        )
    print_table(table)
    for name, why in failed.items():
        console.print(f"[red]tier {name} unreachable:[/] {why}", highlight=False)
    if failed:
        raise typer.Exit(1)  # the table is not the whole store
    return None


@tiers_app.command("du")
def tiers_du(root: RootOpt = None, as_json: JsonOpt = False) -> None:
    """Usage of each tier: checkpoints, logical bytes, stored bytes after dedup."""
    return print_usage_by_tier(_root(root), as_json)
