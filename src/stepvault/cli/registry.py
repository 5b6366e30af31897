"""Registry, evaluation and trust commands: annotate, register, promote, rollback, models,
lineage, keygen, sign."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.tree import Tree

from ..catalog.annotations import annotate
from ..catalog.refs import parse_ref
from ..errors import StepvaultError
from ..registry import Registry, lineage_report
from ..store import Store
from ..store.signing import Signer, signer_from_env
from .common import (
    JsonOpt,
    RootOpt,
    _emit_json,
    _fail,
    _root,
    _time,
    app,
    console,
    existing_name,
)
from .mirrors import MlflowOpt, mlflow_sync
from .output import print_table

KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key",
        help="Signing key: Ed25519 private key PEM, or hmac:SECRET (default: "
        "$STEPVAULT_SIGNING_KEY; unsigned when neither is set).",
    ),
]


def _exact(ref: str) -> tuple[str, int]:
    run, step = parse_ref(ref)
    if not isinstance(step, int):
        raise StepvaultError(f"{ref!r}: name an exact checkpoint as RUN@STEP")
    return run, step


def _signer(key: str | None) -> Signer | None:
    return Signer.from_spec(key) if key else signer_from_env()


def _parse_metrics(pairs: list[str]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise StepvaultError(f"{pair!r}: write metrics as NAME=VALUE, e.g. val_loss=2.31")
        try:
            metrics[name] = float(value)
        except ValueError:
            raise StepvaultError(f"{pair!r}: {value!r} is not a number") from None
    return metrics


@app.command("annotate")
def annotate_cmd(
    ref: Annotated[str, typer.Argument(help="RUN@STEP to annotate.")],
    metrics: Annotated[list[str], typer.Argument(help="NAME=VALUE pairs, e.g. val_loss=2.31.")],
    note: Annotated[str, typer.Option(help="Free text kept with the record.")] = "",
    key: KeyOpt = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Attach evaluation metrics to a checkpoint after the fact (best-k and 'best' use them)."""
    try:
        run, step = _exact(ref)
        # Through every tier (an archived checkpoint too); the record goes to hot, where
        # listings and keep policies read annotations.
        from ..tiers.view import read_view

        view = read_view(Store.open(_root(root)))
        record = annotate(view, run, step, _parse_metrics(metrics), note=note, signer=_signer(key))
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(record)
    shown = ", ".join(f"{k}={v:g}" for k, v in record["metrics"].items())
    console.print(f"annotated {run}@{step}: {shown}", highlight=False)
    return None


def _export_info(store: Store, run: str, step: int, out: str, **options: Any) -> dict[str, Any]:
    """Export with the same exporter as ``stepvault export``; the record keeps every file's
    BLAKE3 (``name`` relative to the folder) for ``stepvault verify-export``."""
    from ..ops.export_hf import export_checkpoint, file_blake3

    report = export_checkpoint(store, run, step, out, **options)
    if isinstance(report.files[0], dict):  # a model folder (hf / folder formats)
        names = [f["path"] for f in report.files] + ["stepvault-export.json"]
        paths = [os.path.join(report.out, n) for n in names]
        options = {**options, "format": report.format}
    else:
        paths = list(report.files)
        names = [os.path.basename(p) for p in paths]
    files = [
        {"path": os.path.abspath(p), "name": n, "blake3": file_blake3(p)}
        for p, n in zip(paths, names)
    ]
    return {
        "files": files,
        "tensors": report.tensors,
        "bytes": report.total_bytes,
        "options": {k: v for k, v in options.items() if v},
        "quantization": {k: v for k, v in (report.quantization or {}).items() if k != "per_tensor"}
        or None,
    }


ExportFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format", help="With --export: hf, folder or safetensors (default: see export)."
    ),
]


@app.command("register")
def register_cmd(
    model: Annotated[str, typer.Argument(help="Model name.")],
    ref: Annotated[str, typer.Argument(help="RUN@STEP of the checkpoint.")],
    export: Annotated[
        str | None, typer.Option("--export", help="Also export the weights to this DIR/FILE.")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="With --export: cast floats.")] = None,
    quantize: Annotated[str | None, typer.Option(help="With --export: 'int8' (lossy).")] = None,
    module: Annotated[str | None, typer.Option(help="With --export: module to export.")] = None,
    export_format: ExportFormatOpt = None,
    note: Annotated[str, typer.Option(help="Free text kept with the version.")] = "",
    key: KeyOpt = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Register a checkpoint as a new version of MODEL (it is then protected from GC)."""
    try:
        run, step = _exact(ref)
        store = Store.open(_root(root))
        info = None
        if export:
            info = _export_info(
                store,
                run,
                step,
                export,
                dtype=dtype,
                quantize=quantize,
                module=module,
                format=export_format,
            )
        version = Registry(store, signer=_signer(key)).register(
            model, run, step, note=note, export=info
        )
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(version.to_json())
    console.print(f"{model} v{version.version} = {version.ref}", highlight=False)
    return None


@app.command("promote")
def promote_cmd(
    model: Annotated[str, typer.Argument(help="Model name (created on first use).")],
    target: Annotated[str, typer.Argument(help="RUN@STEP, or an existing version as vN.")],
    alias: Annotated[str, typer.Option("--alias", "-a", help="e.g. candidate, stable.")],
    export: Annotated[
        str | None,
        typer.Option("--export", help="RUN@STEP target: export it to DIR for this version."),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="With --export: cast floats.")] = None,
    quantize: Annotated[str | None, typer.Option(help="With --export: 'int8' (lossy).")] = None,
    export_format: ExportFormatOpt = None,
    note: Annotated[str, typer.Option(help="Why (kept in the history).")] = "",
    key: KeyOpt = None,
    mlflow: MlflowOpt = False,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Point MODEL@ALIAS at a checkpoint (registering it as a new version if needed)."""
    try:
        if mlflow:  # an alias moved in MLflow is refused before stepvault moves anything
            mlflow_sync(_root(root), model, moved=False)
        registry = Registry(_root(root), signer=_signer(key))
        if export:  # the same exporter as 'register --export'; the version records the files
            run, step = _exact(target)
            info = _export_info(
                registry.store,
                run,
                step,
                export,
                dtype=dtype,
                quantize=quantize,
                format=export_format,
            )
            version = registry.register(model, run, step, note=note, export=info)
            target = f"v{version.version}"
        move = registry.promote(model, target, alias, note=note)
        mirrored = mlflow_sync(_root(root), model, moved=True) if mlflow else None
    except (StepvaultError, ValueError, ImportError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({**move.to_json(), **({"mlflow": mirrored} if mlflow else {})})
    was = f" (was v{move.previous})" if move.previous is not None else ""
    console.print(f"{model}@{alias} -> v{move.version}{was}", highlight=False)
    if mirrored is not None:
        console.print(f"MLflow {model}@{alias} -> version {mirrored[alias]}", highlight=False)
    return None


@app.command("rollback")
def rollback_cmd(
    model: Annotated[str, typer.Argument(help="Model name.")],
    alias: Annotated[str, typer.Option("--alias", "-a", help="Alias to move back.")],
    note: Annotated[str, typer.Option(help="Why (kept in the history).")] = "",
    key: KeyOpt = None,
    mlflow: MlflowOpt = False,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move MODEL@ALIAS back to the version it held before."""
    try:
        if mlflow:
            mlflow_sync(_root(root), model, moved=False)
        move = Registry(_root(root), signer=_signer(key)).rollback(model, alias, note=note)
        mirrored = mlflow_sync(_root(root), model, moved=True) if mlflow else None
    except (StepvaultError, ValueError, ImportError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({**move.to_json(), **({"mlflow": mirrored} if mlflow else {})})
    console.print(f"{model}@{alias} -> v{move.version} (was v{move.previous})", highlight=False)
    if mirrored is not None:
        console.print(f"MLflow {model}@{alias} -> version {mirrored[alias]}", highlight=False)
    return None


@app.command("models")
def models_cmd(
    model: Annotated[str | None, typer.Argument(help="One model; all when omitted.")] = None,
    history: Annotated[bool, typer.Option("--history", help="Every alias move.")] = False,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Registered models: versions, aliases and (with --history) every alias move."""
    try:
        reg = Registry(_root(root))
        known = reg.models()
        # a typo must not read as a model with no versions: name the models there are
        names = (
            [existing_name("model", model, known, _root(root), "stepvault models")]
            if model
            else known
        )
        data: list[dict[str, Any]] = [
            {
                "model": name,
                "aliases": reg.aliases(name),
                "versions": [v.to_json() for v in reg.versions(name)],
                "history": [m.to_json() for m in reg.history(name)] if history else None,
            }
            for name in names
        ]
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(data)
    if not data:
        console.print("no models registered")
    for d in data:
        table = Table(title=d["model"], title_justify="left")
        for col in ("version", "checkpoint", "aliases", "registered", "by", "export", "note"):
            table.add_column(col)
        for v in d["versions"]:
            held = ", ".join(a for a, n in d["aliases"].items() if n == v["version"])
            exported = len((v["export"] or {}).get("files", []))
            table.add_row(
                f"v{v['version']}",
                f"{v['run']}@{v['step']}",
                held,
                _time(v["created"]),
                v["user"],
                f"{exported} files" if exported else "",
                v["note"],
            )
        print_table(table)
        if d["history"]:
            hist = Table(title=f"{d['model']}: alias history", title_justify="left")
            for col in ("#", "time", "alias", "action", "to", "from", "by", "note"):
                hist.add_column(col)
            for m in d["history"]:
                hist.add_row(
                    str(m["seq"]),
                    _time(m["time"]),
                    m["alias"],
                    m["action"],
                    f"v{m['version']}" if m["version"] else "-",
                    f"v{m['previous']}" if m["previous"] else "-",
                    m["user"],
                    m["note"],
                )
            print_table(hist)
    return None


def _describe(node: dict[str, Any], tree: Tree) -> None:
    branch = tree.add(
        f"checkpoint [bold]{node['run']}@{node['step']}[/] ({node['kind']}, "
        f"{_time(node['created'])}) manifest {node['manifest_blake3'][:16]}"
    )
    if node.get("warning"):
        branch.add(f"[yellow]warning:[/] {node['warning']}")
    if node.get("metrics"):
        branch.add("metrics: " + ", ".join(f"{k}={v:g}" for k, v in node["metrics"].items()))
    lin = node.get("lineage")
    if lin is None:
        branch.add(node.get("lineage_error") or "[dim]no lineage recorded[/]")
    else:
        code = lin.get("code") or {}
        if code:
            dirty = " [yellow](dirty)[/]" if code.get("dirty") else ""
            branch.add(
                f"code: git {str(code.get('git_commit'))[:12]}{dirty} "
                f"{code.get('git_branch') or ''} {code.get('repository') or ''}"
            )
        else:
            branch.add("code: [dim]not in a git repository[/]")
        if lin.get("config") is not None:
            cfg = branch.add("config")
            items = lin["config"].items() if isinstance(lin["config"], dict) else []
            for k, v in list(items)[:40]:
                cfg.add(f"{k} = {v}")
        if lin.get("data") is not None:
            branch.add(f"data: {lin['data']}")
        env = lin.get("environment") or {}
        branch.add("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    parent = node.get("parent")
    if parent:
        if "error" in parent:
            branch.add(f"[red]parent {parent['run']}@{parent['step']}: {parent['error']}[/]")
        else:
            _describe(parent, branch.add("[bold]parent[/] (fine-tuned from)"))


@app.command("lineage")
def lineage_cmd(
    spec: Annotated[str, typer.Argument(help="MODEL@ALIAS, MODEL@vN, MODEL, or RUN@STEP.")],
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """How a model or checkpoint was made: version, checkpoint, run, config, code, data,
    environment and parent (followed back through fine-tunes)."""
    try:
        report = lineage_report(Store.open(_root(root)), spec)
    except (StepvaultError, ValueError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(report)
    if report["model"]:
        v = report["version"]
        aliases = ", ".join(report.get("aliases") or []) or "no alias"
        tree = Tree(f"model [bold]{report['model']}[/] v{v['version']} ({aliases})")
    else:
        tree = Tree(f"[bold]{spec}[/]")
    _describe(report["checkpoint"], tree)
    console.print(tree, highlight=False)
    return None
