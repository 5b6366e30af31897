"""``stepvault import`` (alias ``stepvault migrate``): bring existing HF / Lightning / DCP /
Accelerate FSDP / torch / safetensors checkpoints into a store."""

from __future__ import annotations

from typing import Annotated, Any

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
            "it), a Lightning .ckpt, a .pt/.pth file, a .safetensors file, a "
            "torch.distributed.checkpoint directory, or an Accelerate FSDP save_state folder "
            "(pytorch_model_fsdp_0/, optimizer_0/, random_states_<rank>.pkl...; these two "
            "need --step and --trust)."
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
    """Import existing checkpoints as RUN@STEP (pickles load weights-only unless --trust).

    Also available as `stepvault migrate`.
    """
    from ..ops.migrate import import_checkpoints  # torch and safetensors load only when needed

    try:
        with progress_bars(as_json=as_json) as bars:
            reports = _import_dcp(path, run, step, fmt, trust, codec, overwrite, root)
            reports = reports or import_checkpoints(
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
        out = [{**r.to_json(), "missing": _missing(r)} for r in reports]
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
        attached = getattr(report, "attachments", None)  # HF config, tokenizer... (issue 28)
        if attached:
            console.print("  attached: " + ", ".join(attached), highlight=False)
        for entry, why in _missing(report).items():
            console.print(
                f"  missing {entry}: {why}; a resume from it starts the {entry} fresh",
                highlight=False,
            )
        for fname, reason in report.skipped:
            console.print(f"  skipped {fname}: {reason}", highlight=False)
    return None


# One verb, two names: `migrate` is what the module (ops.migrate) and MIGRATION.md call it.
app.command(
    "migrate", help="Alias of `stepvault import`: import existing checkpoints as RUN@STEP."
)(import_cmd)


def _missing(report: Any) -> dict[str, str]:
    """What a training resume needs that the import does not hold: entry -> why (what the
    importer recorded, and an optimizer when only weights came in)."""
    from ..ops.migrate.base import WEIGHTS_ONLY

    missing = dict(getattr(report, "missing", None) or {})
    kinds = {kind.partition(":")[0] for kind in report.entries.values()}
    if "module" in kinds and "optimizer" not in kinds and "optimizer" not in missing:
        missing["optimizer"] = WEIGHTS_ONLY
    return missing


def _import_dcp(
    path: str,
    run: str,
    step: int | None,
    fmt: str | None,
    trust: bool,
    codec: str | None,
    overwrite: bool,
    root: str | None,
) -> list[Any]:
    """A torch.distributed.checkpoint directory through `import` (as `import-dcp` does);
    an empty list when ``path`` is not one."""
    from ..ops.migrate import DcpImporter
    from ..ops.migrate.commit import commit_imported
    from ..store import validate_run_name, validate_step

    importer = DcpImporter()
    if fmt is not None or not importer.detect(path):
        return []
    importer.refuse_unreadable(path)  # Accelerate's per-rank FSDP files: the way out
    if step is None:
        raise StepvaultError(
            f"{path}: {importer.what(path)} records no step; pass --step N "
            "(and --trust; `stepvault import-dcp` is the same command)"
        )
    validate_run_name(run)
    validate_step(step)
    imported = importer.read(path, trust=trust)
    return [
        commit_imported(_root(root), imported, run=run, step=step, codec=codec, overwrite=overwrite)
    ]


def _is_run_dir(path: str) -> bool:
    from ..ops.migrate import hf_checkpoint_folders, is_hf_checkpoint

    try:
        return not is_hf_checkpoint(path) and bool(hf_checkpoint_folders(path))
    except OSError:
        return False
