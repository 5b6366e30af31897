"""Attachment and deployment commands: attach, attachments, diff, verify-export."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from ..catalog.events import log_event
from ..catalog.refs import resolve_ref
from ..errors import StepvaultError
from ..format import parse_manifest
from ..store import Store
from .common import (
    JsonOpt,
    RootOpt,
    _emit_json,
    _fail,
    _root,
    app,
    console,
    human_bytes,
)
from .output import print_table


def _attachments(store: Store, run: str, step: int) -> dict[str, Any]:
    from ..catalog.attachments import checkpoint_attachments

    return checkpoint_attachments(store, run, step)


def attachments_json(store: Store, run: str, step: int) -> list[dict[str, Any]]:
    """The attachments of ``run@step`` (saved with it and attached later) as JSON rows."""
    return [a.to_json() for a in _attachments(store, run, step).values()]


def print_attachments(store: Store, run: str, step: int) -> None:
    """One line per attachment, for ``stepvault show``."""
    try:
        rows = _attachments(store, run, step)
    except StepvaultError as exc:  # a damaged attachment record: say so, show the rest
        console.print(f"[red]attachments: {exc}[/]", highlight=False)
        return
    if not rows:
        return
    shown = ", ".join(
        f"{a.name} ({human_bytes(a.size)}{'' if a.origin == 'checkpoint' else ', attached later'})"
        for a in rows.values()
    )
    console.print(f"attachments: {shown}", highlight=False)


@app.command("attach")
def attach_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP to attach the files to.")],
    files: Annotated[list[str], typer.Argument(help="Files (NAME=PATH to store under NAME).")],
    note: Annotated[str, typer.Option(help="Free text kept with the record.")] = "",
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Attach small files (config.json, tokenizer files...) to a committed checkpoint.

    The manifest is not rewritten (its hash is what annotations, signatures and the
    registry refer to): an attachment record is added next to it (FORMAT.md §8)."""
    from ..catalog.attachments import attach_after
    from ..tiers.view import read_view

    try:
        store = Store.open(_root(root))
        # Through every tier (an archived checkpoint too); the record goes to hot, where
        # show, diff and export read attachments.
        view = read_view(store)
        run, step = resolve_ref(view, ref)
        sources: dict[str, str] = {}
        for item in files:
            name, sep, path = item.partition("=")
            if not sep:
                name, path = os.path.basename(item), item
            sources[name] = path
        record = attach_after(view, run, step, sources, note=note)
        log_event(store, run, "attach", step=step, files=sorted(record["files"]), note=note)
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(record)
    console.print(
        f"attached {', '.join(record['files'])} to {run}@{step} ({record['key']})",
        highlight=False,
    )
    return None


@app.command("diff")
def diff_cmd(
    before: Annotated[str, typer.Argument(help="RUN@STEP (the older one).")],
    after: Annotated[str, typer.Argument(help="RUN@STEP (the newer one).")],
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare two checkpoints (any tier): their attachments, and per tensor whether it is
    equal, its max/mean absolute and relative change, and the bytes an exact or a light
    checkpoint would take for it. Only tensors whose chunks differ are read."""
    from ..catalog.attachments import diff_attachments
    from ..ops.tensor_diff import diff_manifests
    from ..tiers.view import read_view

    try:
        store = read_view(Store.open(_root(root)))
        (ra, sa), (rb, sb) = resolve_ref(store, before), resolve_ref(store, after)
        files = diff_attachments(_attachments(store, ra, sa), _attachments(store, rb, sb))
        ma = parse_manifest(store.read_manifest(ra, sa), before)
        mb = parse_manifest(store.read_manifest(rb, sb), after)
        report = diff_manifests(store, ma, mb)
    except StepvaultError as exc:
        return _fail(exc)
    doc = report.to_json()
    if as_json:
        return _emit_json({"attachments": files, **doc})
    table = Table("attachment", "status", "before", "after", title=f"{before} -> {after}")
    for row in files:
        table.add_row(
            row["name"],
            row["status"],
            (row["before"] or {}).get("blake3", "")[:12],
            (row["after"] or {}).get("blake3", "")[:12],
        )
    if files:
        print_table(table)

    def num(x: float | None) -> str:
        return "" if x is None else f"{x:.3g}"

    tensors = Table(
        "tensor", "status", "max |Δ|", "mean |Δ|", "rel", "exact", "light", title="tensors"
    )
    for t in report.tensors:
        tensors.add_row(
            t.name,
            t.status,
            num(t.max_abs),
            num(t.mean_abs),
            num(t.rel),
            human_bytes(t.exact_bytes),
            human_bytes(t.light_bytes),
        )
    print_table(tensors)
    counts = ", ".join(f"{n} {status}" for status, n in doc["counts"].items()) or "none"
    console.print(
        f"tensors: {counts}; an exact checkpoint of {after} after {before} "
        f"stores {human_bytes(report.exact_bytes)} of new chunks, a light one "
        f"~{human_bytes(report.light_bytes)}",
        highlight=False,
    )
    return None


@app.command("verify-export")
def verify_export_cmd(
    folder: Annotated[str, typer.Argument(help="An exported model folder.")],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="MODEL, MODEL@ALIAS or MODEL@vN: also check against the file hashes the "
            "registry recorded for that version (needs the store: --root).",
        ),
    ] = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash every file of an exported folder; exits 1 if any changed, went missing or was
    added."""
    from ..ops.export_hf import verify_export

    try:
        expected = None
        if model is not None:
            from ..registry import Registry

            version = Registry(_root(root)).resolve(model)
            if not version.export:
                raise StepvaultError(
                    f"{model} (v{version.version}) was registered without --export: the "
                    "registry has no file hashes to check against"
                )
            expected = version.export["files"]
        check = verify_export(folder, expected)
    except (StepvaultError, OSError) as exc:
        return _fail(exc)
    if as_json:
        _emit_json(check.to_json())
    else:
        src = check.source or {}
        for p in check.problems:
            console.print(f"[red]CHANGED[/]  {p}", highlight=False)
        verdict = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
        against = "the registry's record" if check.anchored else "its stepvault-export.json"
        console.print(
            f"{verdict} {folder}: {check.checked} files checked against {against} "
            f"(from {src.get('run')}@{src.get('step')})",
            highlight=False,
        )
    if not check.ok:
        raise typer.Exit(1)
    return None
