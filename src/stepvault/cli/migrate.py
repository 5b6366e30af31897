"""``stepvault import``: bring existing HF / Lightning / torch checkpoints into a store."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import StepvaultError
from .common import JsonOpt, RootOpt, _emit_json, _fail, _root, app, console, human_bytes
from .progress import progress_bars


@app.command("import")
def import_cmd(
    path: Annotated[
        str,
        typer.Argument(
            help="An HF checkpoint-N folder (or a Trainer output dir: every checkpoint-N in "
            "it), a Lightning .ckpt, a .pt/.pth file or a .safetensors file."
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
    """Import existing checkpoints as RUN@STEP (pickles load weights-only unless --trust)."""
    from ..ops.migrate import import_checkpoints  # torch and safetensors load only when needed

    try:
        with progress_bars(as_json=as_json) as bars:
            reports = import_checkpoints(
                _root(root),
                path,
                run=run,
                step=step,
                format=fmt,  # type: ignore[arg-type]  # any str: read_checkpoint checks FORMATS
                trust=trust,
                codec=codec,
                overwrite=overwrite,
                progress=bars.task(f"import {path}"),
            )
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        # One checkpoint: its report; a Trainer output directory: the list of reports.
        out = [r.to_json() for r in reports]
        return _emit_json(out[0] if len(out) == 1 and not _is_run_dir(path) else out)
    for report in reports:
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
        if report.attachments:
            console.print("  attached: " + ", ".join(report.attachments), highlight=False)
        for entry, why in report.missing.items():
            console.print(
                f"  missing {entry}: {why}; a resume from it starts the {entry} fresh",
                highlight=False,
            )
        for fname, reason in report.skipped:
            console.print(f"  skipped {fname}: {reason}", highlight=False)
    return None


def _is_run_dir(path: str) -> bool:
    from ..ops.migrate import hf_checkpoint_folders, is_hf_checkpoint

    try:
        return not is_hf_checkpoint(path) and bool(hf_checkpoint_folders(path))
    except OSError:
        return False
