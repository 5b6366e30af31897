"""``stepvault`` command line: ls, show, verify, du, gc, pin, events, repair, export, ...

Shared options and helpers are in :mod:`stepvault.cli.common`; each further command group
lives in its own module, imported at the bottom of this file so that it registers on ``app``.

(Longer than most modules: the core commands, each a short function of options and output
registered on the one ``app``; a group of commands that grows gets its own module, as the
ones imported at the bottom.)
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..catalog.events import log_event, read_events
from ..catalog.refs import latest_step, parse_ref
from ..core.opened import open_vault
from ..errors import StepvaultError
from ..store import Store
from .common import (
    JsonOpt,
    RootOpt,
    _emit_json,
    _fail,
    _ops,
    _root,
    _time,
    app,
    checkpoint_home,
    console,
    duration_option,
    existing_run,
    human_bytes,
)
from .output import print_table
from .progress import progress_bars


@app.command("ls")
def ls_cmd(
    run: Annotated[str | None, typer.Argument(help="Run to list; all runs when omitted.")] = None,
    root: RootOpt = None,
    limit: Annotated[
        int | None,
        typer.Option(help="Show the newest N checkpoints (default 50; --json: all); 0: all."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only from this step on (e.g. 1200), or this recent (e.g. 2h, 7d)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, or the checkpoints of RUN with step, time, sizes and metrics."""
    try:
        vault = open_vault(_root(root))
        if run is None:
            rows: list[dict] = []
            for name in vault.runs():
                steps = vault.steps(name)
                rows.append(
                    {"run": name, "checkpoints": len(steps), "latest": steps[-1] if steps else None}
                )
            if as_json:
                return _emit_json(rows)
            table = Table("run", "checkpoints", "latest step", title=f"runs in {vault.url}")
            for r in rows:
                table.add_row(r["run"], str(r["checkpoints"]), str(r["latest"]))
            print_table(table)
            return None
        from .listing import list_checkpoints

        existing_run(vault.store, run)  # a typo is an error, not an empty listing
        return list_checkpoints(vault, run, limit=limit, since=since, as_json=as_json)
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)


@app.command("show")
def show_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP (or RUN for the latest).")],
    root: RootOpt = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show one checkpoint: metadata, metrics, sizes, state layout and (optionally) tensors."""
    try:
        run, step = _checkpoint_or_model(_root(root), ref)
        ckpt = open_vault(_root(root)).checkpoint(run, step)
    except StepvaultError as exc:
        return _fail(exc)
    m = ckpt.manifest
    metrics, protected = _show_extras(ckpt.store, m.run, m.step, dict(m.metrics))
    if as_json:
        doc = m.to_json()
        doc.pop("state", None)
        doc["metrics"], doc["saved_metrics"], doc["protected"] = metrics, dict(m.metrics), protected
        from .attachments import attachments_json  # issue 19: with later attached files

        doc["attachments"] = attachments_json(ckpt.store, m.run, m.step)
        from ..tiers.view import TieredView

        if isinstance(ckpt.store, TieredView):
            doc["tiers"] = ckpt.store.where(m.run, m.step)
        if not tensors:
            doc["tensors"] = len(m.tensors)
            doc["objects"] = len(m.objects)
        return _emit_json(doc)
    console.print(
        f"[bold]{m.run}@{m.step}[/]  kind={m.kind}  epoch={m.epoch}  "
        f"parent={m.parent_step}  created={_time(m.created)}",
        highlight=False,
    )
    from ..tiers.view import TieredView

    if isinstance(ckpt.store, TieredView):  # a store with cold tiers: where it is
        console.print(f"tiers: {', '.join(ckpt.store.where(m.run, m.step))}", highlight=False)
    console.print(
        f"tensors: {len(m.tensors)}  objects: {len(m.objects)}  "
        f"logical: {human_bytes(m.logical_bytes)} (tensor data)  "
        f"stored: {human_bytes(m.stored_bytes)} (all its objects: tensors, other state, "
        f"object headers; after compression)  "
        f"new in this save: {human_bytes(m.stats.get('new_bytes', 0))} (objects not "
        "already in the store)",
        highlight=False,
    )
    if metrics:
        annotated = sorted(k for k, v in metrics.items() if m.metrics.get(k) != v)
        later = f" (annotated later: {', '.join(annotated)})" if annotated else ""
        console.print("metrics: " + ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()) + later)
    if protected:
        console.print(f"protected: {'; '.join(protected)}", highlight=False)
    console.print("state: " + ", ".join(f"{k} ({v})" for k, v in m.state_kinds.items()))
    console.print(f"environment: {m.environment}", highlight=False)
    from .attachments import print_attachments  # issue 19

    print_attachments(ckpt.store, m.run, m.step)
    from .light import print_light  # issue 17: base and measured error

    print_light(m.light)
    if tensors:
        table = Table("tensor", "dtype", "shape", "bytes", "chunks")
        for name, t in m.tensors.items():
            table.add_row(
                name, t.dtype, str(tuple(t.shape)), human_bytes(t.nbytes), str(len(t.chunks))
            )
        print_table(table)
    return None


@app.command("verify")
def verify_cmd(
    ref: Annotated[
        str | None, typer.Argument(help="RUN or RUN@STEP; everything if omitted.")
    ] = None,
    root: RootOpt = None,
    deep: Annotated[bool, typer.Option("--deep", help="Decode and re-hash every object.")] = False,
    signatures: Annotated[
        bool,
        typer.Option(
            "--signatures",
            help="Also check signatures of manifests, annotations and the registry "
            "(key: --key or $STEPVAULT_VERIFY_KEY).",
        ),
    ] = False,
    key: Annotated[
        str | None,
        typer.Option(help="Public key PEM file, or hmac:SECRET, for --signatures."),
    ] = None,
    require: Annotated[
        bool, typer.Option("--require", help="With --signatures: unsigned records fail too.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check checkpoints; exits 1 if anything is damaged or missing, 2 on usage errors."""
    try:
        run, step = parse_ref(ref) if ref else (None, None)
        if run is not None:  # a typo is an error naming the runs, not "0 damaged"
            from ..tiers.view import read_view

            view = read_view(Store.open(_root(root)))  # every tier, as restore reads them
            existing_run(view, run)
            if step == "latest":  # RUN alone verifies the whole run
                step = latest_step(view, run)
        with progress_bars(as_json=as_json) as bars:  # deep: every byte is re-hashed
            task = bars.task("verify --deep" if deep else "verify")
            report = _ops().verify(_root(root), run, step, deep=deep, progress=task)
        registry: list[dict] = []
        if run is None and not signatures:  # (--signatures reports the registry itself)
            from ..registry import Registry

            registry = [e for e in Registry(_root(root)).check() if e["status"] != "ok"]
        sig_report = None
        if signatures:
            from ..store.signing import Verifier, verifier_from_env

            verifier = Verifier.from_spec(key) if key else verifier_from_env()
            if verifier is None:
                raise StepvaultError(
                    "--signatures needs a key: --key PUBLIC.pem (or hmac:SECRET), or set "
                    "$STEPVAULT_VERIFY_KEY"
                )
            sig_report = _ops().verify_signatures(
                Store.open(_root(root)), verifier, run=run, require=require
            )
    except StepvaultError as exc:
        return _fail(exc)
    if sig_report is not None and as_json:
        _emit_json({**report.to_json(), "registry": registry, "signatures": sig_report.to_json()})
        if not report.ok or not sig_report.ok or registry:
            raise typer.Exit(1)
        return None
    if as_json:
        _emit_json({**report.to_json(), "registry": registry})
    else:
        mode = "deep" if deep else "quick"
        for c in report.checkpoints:
            # a store with cold tiers: say where each checkpoint was verified
            where = f"  (in {', '.join(c.tiers)})" if c.tiers and c.tiers != ["hot"] else ""
            if c.ok:
                console.print(f"[green]ok[/]       {c.run}@{c.step}{where}", highlight=False)
            else:
                console.print(f"[red]DAMAGED[/]  {c.run}@{c.step}{where}", highlight=False)
                for p in c.problems:
                    console.print(f"         - {p}", highlight=False)
        for name, why in report.unreachable.items():
            console.print(
                f"[red]NOT CHECKED[/]  tier {name}: unreachable ({why}); what only it holds "
                "is not listed above",
                highlight=False,
            )
        console.print(
            f"{mode} verify: {len(report.checkpoints)} checkpoints, {report.objects_checked} "
            f"objects ({human_bytes(report.bytes_checked)}), {len(report.damaged)} damaged",
            highlight=False,
        )
        if report.damaged:
            console.print(
                "restore already falls back past damaged checkpoints; 'stepvault repair' "
                "(--dry-run first) quarantines them so nothing offers them again",
                highlight=False,
            )
    if not as_json:
        for e in registry:
            detail = f" ({e['detail']})" if e.get("detail") else ""
            console.print(
                f"[red]{e['status'].upper()}[/]  registry {e['kind']} {e['key']}{detail}",
                highlight=False,
            )
    if sig_report is not None:
        for e in sig_report.problems:
            where = e.get("ref") or e.get("key")
            detail = f" ({e['detail']})" if e.get("detail") else ""
            console.print(
                f"[red]{e['status'].upper()}[/]  {e['kind']} {where}{detail}", highlight=False
            )
        counts = ", ".join(f"{n} {s}" for s, n in sig_report.to_json()["counts"].items())
        console.print(f"signatures: {counts or 'nothing to check'}", highlight=False)
    if not report.ok or (not report.checkpoints and ref) or registry:
        raise typer.Exit(1)
    if sig_report is not None and not sig_report.ok:
        raise typer.Exit(1)
    return None


@app.command("du")
def du_cmd(
    root: RootOpt = None,
    by_tier: Annotated[
        bool, typer.Option("--by-tier", help="Usage of each storage tier (see STORAGE.md).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Logical vs stored bytes, with dedup and compression savings (or per tier)."""
    if by_tier:
        from .tiers import print_usage_by_tier

        return print_usage_by_tier(_root(root), as_json)
    try:
        u = _ops().usage(_root(root))
    except StepvaultError as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(u.to_json())
    table = Table("run", "checkpoints", "logical", "unique stored", title="usage by run")
    for r in u.runs:
        table.add_row(
            r.run,
            str(r.checkpoints),
            human_bytes(r.logical_bytes),
            human_bytes(r.unique_stored_bytes),
        )
    print_table(table)
    ratio = u.stored_bytes / u.logical_bytes if u.logical_bytes else 0.0
    # Small checkpoints: headers, state structure and non-tensor values outweigh tensor data
    # and what compression gains; say so instead of a negative saving or a ratio above 1.
    comp = u.compression_savings
    comp_text = (
        f"compression saved {human_bytes(comp)}"
        if comp >= 0
        else f"object headers and framing add {human_bytes(-comp)}; compression saved nothing"
    )
    overhead = (
        "  (above 1: object headers and non-tensor state outweigh tensor data, as in "
        "small checkpoints)"
        if ratio > 1
        else ""
    )
    console.print(
        f"logical (tensor data of every checkpoint, full copies): "
        f"{human_bytes(u.logical_bytes)}\n"
        f"after dedup (objects, incl. non-tensor state): {human_bytes(u.raw_bytes)}  "
        f"(saved {human_bytes(max(0, u.dedup_savings))})\n"
        f"stored (objects as written, with headers): {human_bytes(u.stored_bytes)}  "
        f"({comp_text})\n"
        f"stored / logical: {ratio:.3f}{overhead}\n"
        f"objects: {u.objects}; unreferenced: {u.unreferenced_objects} "
        f"({human_bytes(u.unreferenced_bytes)})",
        highlight=False,
    )
    return None


@app.command("repair")
def repair_cmd(
    run: Annotated[str | None, typer.Argument(help="Run to repair; all runs if omitted.")] = None,
    root: RootOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report, change nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Deep-verify, then quarantine damaged checkpoints and objects so they are never offered
    again (manifests go to quarantine/manifests/, objects to quarantine/)."""
    from ..tiers.view import TieredView, read_view

    try:
        store = Store.open(_root(root))
        view = read_view(store)  # every tier: what `verify` checks, repair repairs
        if run is not None:
            existing_run(view, run)  # a typo must not read as "0 checkpoints checked"
        tiers = view._stores() if isinstance(view, TieredView) else [("hot", store)]
        reports = [
            (name, _ops().repair_store(tier, run=run, dry_run=dry_run))
            for name, tier in tiers
            if run is None or run in tier.list_runs()
        ]
    except StepvaultError as exc:
        return _fail(exc)
    unreachable = view.unreachable if isinstance(view, TieredView) else {}
    if as_json:
        doc = reports[0][1].to_json() if len(tiers) == 1 and reports else {}
        if len(tiers) > 1 or not reports:
            doc = {"tiers": {name: r.to_json() for name, r in reports}}
        return _emit_json({**doc, "unreachable": unreachable})
    verb = "would quarantine" if dry_run else "quarantined"
    for name, report in reports:
        where = f" in {name}" if len(tiers) > 1 else ""
        for c in report.verify.damaged:
            console.print(
                f"[red]{verb}[/] {c.run}@{c.step}{where}: {'; '.join(c.problems)}",
                highlight=False,
            )
        for ref, why in report.protected.items():
            console.print(
                f"[yellow]note:[/] {ref}{where} was {', '.join(why)}: a registry version "
                "naming it cannot be restored; promote another (stepvault promote), or "
                "restore the manifest from quarantine/manifests/ once its objects are back",
                highlight=False,
            )
    for name, why in unreachable.items():
        console.print(f"[yellow]tier {name} not checked:[/] unreachable ({why})")
    console.print(
        f"{sum(len(r.verify.checkpoints) for _, r in reports)} checkpoints checked"
        f"{f' in {len(reports)} tiers' if len(tiers) > 1 else ''}, "
        f"{sum(len(r.removed) for _, r in reports)} {verb}, "
        f"{sum(len(r.quarantined_objects) for _, r in reports)} damaged objects {verb}",
        highlight=False,
    )
    return None


@app.command("export")
def export_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP (or RUN for the latest).")],
    output: Annotated[str, typer.Option("--output", "-o", help="FILE.safetensors or DIR.")],
    root: RootOpt = None,
    module: Annotated[str | None, typer.Option(help="Module to export (if several).")] = None,
    dtype: Annotated[str | None, typer.Option(help="Cast floats, e.g. bfloat16.")] = None,
    include: Annotated[str | None, typer.Option(help="Regex on tensor names.")] = None,
    strip_prefix: Annotated[str | None, typer.Option(help="Remove this name prefix.")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Split a DIR export above this.")] = "5GB",
    quantize: Annotated[
        str | None,
        typer.Option(help="LOSSY: 'int8' = per-channel int8 weights (+ '.scale' tensors)."),
    ] = None,
    export_format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="hf (a from_pretrained folder; default when config.json is attached), "
            "folder (weights + attachments + card), safetensors (weights only).",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(help="config.json (or its folder) of an HF export; implies --format hf."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a checkpoint: a deployable model folder, or weights as safetensors."""
    from ..ops.export_hf import export_checkpoint  # issue 19: one exporter for every format
    from ..tiers.view import read_view

    try:
        run, step = parse_ref(ref)
        with progress_bars(as_json=as_json) as bars:
            report = export_checkpoint(
                read_view(Store.open(_root(root))),  # any tier, as restore reads them
                run,
                step,
                output,
                format=export_format,
                module=module,
                dtype=dtype,
                include=include,
                strip_prefix=strip_prefix,
                max_shard_size=max_shard_size,
                quantize=quantize,
                progress=bars.task(f"export {ref}"),
                config=config,
            )
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(report.to_json())
    files = [f["path"] if isinstance(f, dict) else f for f in report.files]
    fmt = getattr(report, "format", None)
    where = f"{report.out} ({fmt}: {', '.join(files)})" if hasattr(report, "out") else ""
    console.print(
        f"exported {report.tensors} tensors ({human_bytes(report.total_bytes)}) to "
        f"{where or ', '.join(files)}",
        highlight=False,
    )
    if report.quantization:
        q = report.quantization
        console.print(
            f"[yellow]LOSSY[/] {q['scheme']}: {q['tensors']} tensors quantized; relative error "
            f"max {q['max_rel_error']:.3g}, mean {q['mean_rel_error']:.3g}; max abs error "
            f"{q['max_abs_error']:.3g}",
            highlight=False,
        )
    return None


@app.command("import-dcp")
def import_dcp_cmd(
    path: Annotated[
        str,
        typer.Argument(
            help="A torch.distributed.checkpoint directory, or an Accelerate FSDP save_state "
            "folder (pytorch_model_fsdp_0/, optimizer_0/...)."
        ),
    ],
    run: Annotated[str, typer.Option(help="Run to import into.")],
    step: Annotated[int, typer.Option(help="Step of the imported checkpoint.")],
    root: RootOpt = None,
    trust: Annotated[
        bool, typer.Option("--trust", help="UNSAFE for files from others: unpickles metadata.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Import a DCP checkpoint directory (its metadata is a pickle: needs --trust)."""
    try:
        info = _ops().import_dcp(_root(root), path, run=run, step=step, trust=trust)
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(info.__dict__)
    console.print(
        f"imported {path} as {run}@{step}: {human_bytes(info.logical_bytes)} logical, "
        f"{human_bytes(info.new_bytes)} new",
        highlight=False,
    )
    return None


@app.command("gc")
def gc_cmd(
    run: Annotated[
        str | None, typer.Argument(help="Run to apply keep rules to (needed with --keep-*).")
    ] = None,
    root: RootOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show, delete nothing.")] = False,
    keep_last: Annotated[int | None, typer.Option(help="Keep the N newest.")] = None,
    keep_best: Annotated[int | None, typer.Option(help="Keep the N best by --metric.")] = None,
    metric: Annotated[str | None, typer.Option(help="Metric for --keep-best.")] = None,
    mode: Annotated[str, typer.Option(help="min or max, for --keep-best.")] = "min",
    keep_every: Annotated[int | None, typer.Option(help="Keep steps divisible by N.")] = None,
    keep_within: Annotated[str | None, typer.Option(help="Keep all newer than e.g. 7d.")] = None,
    thin_after: Annotated[
        str | None, typer.Option(help="Thin kept ones older than e.g. 7d to their weights.")
    ] = None,
    thin_after_steps: Annotated[
        int | None, typer.Option(help="Thin kept ones N steps behind the newest to weights.")
    ] = None,
    grace: Annotated[
        str, typer.Option(help="Never sweep objects younger than this (in-flight saves).")
    ] = "15m",
    as_json: JsonOpt = False,
) -> None:
    """Delete checkpoints no keep rule keeps (newest, best and pinned always stay), then
    sweep objects that no checkpoint references. Without --keep-* only the sweep runs."""
    from ..policy import KeepBest, KeepEvery, KeepLast, KeepPolicy, KeepWithin

    for option, value in (
        ("--keep-last", keep_last),
        ("--keep-best", keep_best),
        ("--keep-every", keep_every),
        ("--thin-after-steps", thin_after_steps),
    ):
        if value is not None and value < 1:
            why = " (the newest valid checkpoint always stays: --keep-last 1 keeps only it)"
            why = why if option == "--keep-last" else ""
            return _fail(ValueError(f"{option} must be 1 or more, got {value}{why}"))
    if mode not in ("min", "max"):
        return _fail(ValueError(f"--mode must be min or max, got {mode!r}"))
    grace_seconds = duration_option("--grace", grace)
    rules: list[KeepPolicy] = []
    if keep_last is not None:
        rules.append(KeepLast(keep_last))
    if keep_best is not None:
        if metric is None:
            return _fail(ValueError("--keep-best needs --metric"))
        # mode is any str from the command line; KeepBest rejects all but "min"/"max".
        rules.append(KeepBest(keep_best, metric=metric, mode=mode))  # type: ignore[arg-type]
    if keep_every is not None:
        rules.append(KeepEvery(steps=keep_every))
    if keep_within is not None:
        rules.append(KeepWithin(seconds=duration_option("--keep-within", keep_within)))
    if thin_after is not None or thin_after_steps is not None:
        from ..policy import ThinAfter

        if thin_after is not None:
            age = duration_option("--thin-after", thin_after)
            if age <= 0:
                return _fail(
                    ValueError(
                        f"--thin-after must be a positive age such as 7d, got {thin_after!r}"
                    )
                )
            rules.append(ThinAfter(days=age / 86400))
        if thin_after_steps is not None:
            rules.append(ThinAfter(steps=thin_after_steps))
    keep: KeepPolicy | None = None
    for rule in rules:
        keep = rule if keep is None else keep | rule
    try:
        if keep is not None and run is None:
            raise ValueError("keep rules apply to one run: stepvault gc RUN --keep-last 3")
        store = Store.open(_root(root))
        if run is not None:
            existing_run(store, run)  # a typo must not read as "nothing to collect"
        with progress_bars(as_json=as_json, unit="items") as bars:
            result = _ops().collect_garbage(
                store,
                run=run,
                keep=keep,
                dry_run=dry_run,
                grace_seconds=grace_seconds,
                progress=bars.task("gc: objects examined"),
            )
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(result.to_json())
    if result.plan is not None:
        console.print(str(result.plan), highlight=False)
    sw = result.sweep
    deleted = len(result.plan.delete) if result.plan else 0
    what = f"{_count(deleted, 'checkpoint')} and {_count(len(sw.deleted), 'object')}"
    if dry_run:
        head = f"dry run: would delete {what}"
        head += f" (would free {human_bytes(sw.freed_bytes)})"
    else:
        head = f"deleted {what}"
        head += f" (freed {human_bytes(sw.freed_bytes)})"
    console.print(head, highlight=False)
    if sw.kept_in_grace:
        would = "would stay" if dry_run else "stay"
        console.print(
            f"{sw.kept_in_grace} unreferenced objects ({human_bytes(sw.kept_in_grace_bytes)}) "
            f"{would}: younger than the grace period ({grace}), a save in flight may use them; "
            "when no save is running, --grace 0s frees them now",
            highlight=False,
        )
    if sw.unreadable_manifests:
        console.print(
            f"[yellow]sweep skipped: unreadable manifests {sw.unreadable_manifests} may "
            "reference objects; fix or remove them first[/]"
        )
    return None


def _checkpoint_or_model(root: str, ref: str) -> tuple[str, int | str | None]:
    """``RUN@STEP`` / ``RUN``, or a registry reference (``MODEL@ALIAS``, ``MODEL@vN``,
    ``MODEL``) that names a checkpoint: the registry is asked when the reference is not a
    checkpoint's and a model of that name exists."""
    try:
        return parse_ref(ref)
    except StepvaultError:
        from ..registry import Registry

        registry = Registry(Store.open(root))
        if ref.partition("@")[0] not in registry.models():
            raise
        version = registry.resolve(ref)
        return version.run, version.step


def _show_extras(
    store: Store, run: str, step: int, saved: dict[str, float]
) -> tuple[dict[str, float], list[str]]:
    """What ``show`` adds to the manifest: the metrics with later annotations (what ``ls``
    and KeepBest see), and what protects the checkpoint (pins, registry and reader holds)."""
    from ..catalog.annotations import manifest_id, merged_metrics, read_annotations
    from ..store.reader_holds import live_holds

    metrics = merged_metrics(
        saved,
        read_annotations(store, run).get(step, []),
        manifest_id(store.read_manifest(run, step)),
    )
    protected = ["pinned"] if step in store.pinned_steps(run) else []
    protected += [f"held by {h}" for h in store.held_steps(run).get(step, [])]
    holds = live_holds(store, run, clean=False).get(step, [])
    protected += [f"reader hold of {h.owner} until {_time(h.expires)}" for h in holds]
    return metrics, protected


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@app.command("pin")
def pin_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP to protect.")],
    root: RootOpt = None,
    note: Annotated[str, typer.Option(help="Why it is pinned.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Protect a checkpoint from every keep policy and GC."""
    try:
        run, step = parse_ref(ref)
        if not isinstance(step, int):
            raise ValueError("pin needs an exact step: RUN@STEP")
        store = Store.open(_root(root))
        home, tier = checkpoint_home(store, run, step)  # an archived one: in its tier
        home.pin(run, step, note)
        log_event(store, run, "pin", step=step, note=note, **({"tier": tier} if tier else {}))
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        where = {"tier": tier} if tier else {}
        return _emit_json({"run": run, "step": step, "pinned": True, "note": note, **where})
    console.print(f"pinned {run}@{step}{f' (in {tier})' if tier else ''}", highlight=False)
    return None


@app.command("unpin")
def unpin_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP.")],
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a pin; the checkpoint is subject to keep policies again."""
    from ..catalog.retention import not_pinned_reason

    try:
        run, step = parse_ref(ref)
        if not isinstance(step, int):
            raise ValueError("unpin needs an exact step: RUN@STEP")
        store = Store.open(_root(root))
        home, tier = checkpoint_home(store, run, step)
        if step not in home.pinned_steps(run):
            raise ValueError(not_pinned_reason(home, run, step))
        home.unpin(run, step)
        log_event(store, run, "unpin", step=step, **({"tier": tier} if tier else {}))
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({"run": run, "step": step, "pinned": False})
    console.print(f"unpinned {run}@{step}", highlight=False)
    return None


@app.command("events")
def events_cmd(
    run: Annotated[str, typer.Argument(help="Run whose event log to print.")],
    root: RootOpt = None,
    tail: Annotated[int | None, typer.Option(help="Only the last N events.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The run's event log: saves, restores, deletions, failures (with sizes and stalls)."""
    try:
        if tail is not None and tail < 0:
            raise ValueError(f"--tail must be 0 or more events, got {tail}")
        store = Store.open(_root(root))
        events = read_events(store, run)
        if not events:
            existing_run(store, run)  # a typo is an error; a run with no events prints none
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if tail is not None:
        events = events[-tail:] if tail else []
    if as_json:
        return _emit_json(events)
    table = Table("time", "event", "step", "details", title=f"events of {run}")
    skip = {"time", "event", "run", "step", "user", "host", "pid"}
    for e in events:
        details = []
        for k, v in e.items():
            if k in skip or v in (None, [], ""):
                continue
            if k.endswith("_bytes") and isinstance(v, int):
                v = human_bytes(v)
            elif isinstance(v, float):
                v = f"{v:.3g}"
            details.append(f"{k}={v}")
        table.add_row(
            _time(e.get("time", 0)), e.get("event", "?"), str(e.get("step", "")), " ".join(details)
        )
    print_table(table)  # one line per event in a pipe or a narrow terminal
    return None


# Command groups kept in their own modules register on ``app`` when imported (one line each;
# those modules import heavy optional dependencies inside their commands, not at import).
# -- command groups: begin
from . import attachments as _attachments  # noqa: E402,F401  (attach, diff, verify-export)
from . import holds as _holds  # noqa: E402,F401  (hold, holds, release)
from . import mem as _mem  # noqa: E402,F401  (tiers mem-gc; issue 16)
from . import migrate as _migrate  # noqa: E402,F401  (stepvault import)
from . import plan as _plan  # noqa: E402,F401  (stepvault plan)
from . import registry as _registry  # noqa: E402,F401  (annotate, promote, rollback, ...)
from . import signing as _signing  # noqa: E402,F401  (keygen, sign)
from . import tiers as _tiers  # noqa: E402,F401  (tier, tiers ls/add/remove/du)
from . import ui as _ui  # noqa: E402,F401  (ui: imports the web stack only when run)

# -- command groups: end


def main() -> None:
    """Entry point of the ``stepvault`` console script."""
    app()


if __name__ == "__main__":
    main()
