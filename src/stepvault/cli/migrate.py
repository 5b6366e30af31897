"""``stepvault import``: bring existing HF / Lightning / torch checkpoints into a store."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import StepvaultError
from .common import JsonOpt, RootOpt, _emit_json, _fail, _root, app, console, human_bytes


@app.command("import")
def import_cmd(
    path: Annotated[
        str,
        typer.Argument(
            help="An HF checkpoint-N folder, a Lightning .ckpt, a .pt/.pth file or a "
            ".safetensors file."
        ),
    ],
    run: Annotated[str, typer.Option(help="Run to import into.")],
    step: Annotated[
        int | None,
        typer.Option(help="Step of the imported checkpoint (default: the one it records)."),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="Force the input format: hf, lightning, torch, safetensors."),
    ] = None,
    trust: Annotated[
        bool,
        typer.Option(
            "--trust",
            help="UNSAFE for files from others: allow full unpickling (runs code in the file).",
        ),
    ] = False,
    codec: Annotated[
        str | None, typer.Option(help="raw, zstd, float or auto (default: the store's).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing RUN@STEP.")] = False,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Import an existing checkpoint as RUN@STEP (pickles load weights-only unless --trust)."""
    from ..ops.migrate import import_checkpoint  # torch and safetensors load only when needed

    try:
        report = import_checkpoint(
            _root(root),
            path,
            run=run,
            step=step,
            format=fmt,
            trust=trust,
            codec=codec,
            overwrite=overwrite,
        )
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(report.to_json())
    info = report.save
    console.print(
        f"imported {report.source} ({report.format}) as {report.run}@{report.step}: "
        f"{report.tensors} tensors, {human_bytes(info.logical_bytes)} logical, "
        f"{human_bytes(info.new_bytes)} new",
        highlight=False,
    )
    console.print(
        "  entries: " + ", ".join(f"{k} ({v})" for k, v in report.entries.items()),
        highlight=False,
    )
    for fname, reason in report.skipped:
        console.print(f"  skipped {fname}: {reason}", highlight=False)
    return None
