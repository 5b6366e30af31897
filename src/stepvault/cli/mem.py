"""``stepvault tiers mem-gc`` and the mem tier part of ``stepvault tiers ls``: what node
memory a store's runs hold, and reclaiming the mem tiers of dead jobs."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import StepvaultError
from .common import JsonOpt, _emit_json, _fail, console, human_bytes
from .output import print_table
from .tiers import tiers_app

MemRootOpt = Annotated[
    str | None,
    typer.Option(
        "--mem-root",
        help="The mem tier's tmpfs root (default: $STEPVAULT_MEM_ROOT or /dev/shm/stepvault).",
    ),
]


def mem_usage(hot: Any, mem_root: str | None) -> list[dict[str, Any]]:
    """Per run of ``hot``: the mem tier's path, bytes, checkpoints and budget (the budget
    is recorded by the running manager; None for a mem tier left by a dead one)."""
    from ..tiers.mem import mem_tiers_of

    try:
        found = mem_tiers_of(hot, mem_root)
    except StepvaultError:
        return []  # no /dev/shm and no root given: no mem tier to show
    return [
        {
            "run": t.run,
            "path": t.path,
            "bytes": t.bytes,
            "checkpoints": len(t.steps),
            "steps": t.steps,
            "budget": t.budget,
            "stale": t.stale,
        }
        for t in found
    ]


def print_mem_usage(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    table = Table("run", "directory", "bytes", "checkpoints", "budget", "owner", title="mem tier")
    for r in rows:
        budget = human_bytes(r["budget"]) if r["budget"] is not None else "-"
        owner = "gone (stale)" if r["stale"] else "live or needed"
        table.add_row(
            str(r["run"]),
            r["path"].rsplit("/", 1)[-1],  # the full path is in --json
            human_bytes(r["bytes"]),
            str(r["checkpoints"]),
            budget,
            owner,
        )
    print_table(table)


@tiers_app.command("mem-gc")
def tiers_mem_gc(
    mem_root: MemRootOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Reclaim stale mem tiers of dead jobs: owner process gone and its run finished (no
    writer lease) or every checkpoint it holds also on disk (see STORAGE.md)."""
    from ..tiers.mem import reclaim_stale

    try:
        gone = reclaim_stale(mem_root, dry_run=dry_run)
    except StepvaultError as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({"dry_run": dry_run, "reclaimed": [t.to_json() for t in gone]})
    verb = "would remove" if dry_run else "removed"
    for t in gone:
        console.print(f"{verb} {t.path} ({human_bytes(t.bytes)}): {t.reason}")
    if not gone:
        console.print("no stale mem tier")
    return None
