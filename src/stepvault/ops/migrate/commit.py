"""Committing what an importer read: one checkpoint, or every ``checkpoint-N`` folder of a
Trainer output directory, written like any save."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...catalog.attachments import add_attachments
from ...core.info import SaveInfo
from ...core.write import new_manifest, open_store_for_writing, write_manifest
from ...engine import to_host
from ...errors import StepvaultError, UnsupportedTypeError
from ...format import Encoder
from ...state.snapshot import Snapshot
from ...store import validate_run_name, validate_step
from .base import ImportedState
from .hf import hf_checkpoint_folders, is_hf_checkpoint
from .registry import Format, read_checkpoint


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_checkpoint` read and wrote."""

    run: str
    step: int
    format: str
    source: str
    entries: dict[str, str]
    files: list[str]
    skipped: list[tuple[str, str]]
    tensors: int
    save: SaveInfo
    #: training state the source lacks (entry -> why); also ``metadata["missing"]``
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    #: files stored as attachments (``stepvault export`` writes them next to the weights)
    attachments: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["skipped"] = [{"file": f, "reason": r} for f, r in self.skipped]
        return out


def import_checkpoint(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int | None = None,
    format: Format | None = None,
    trust: bool = False,
    codec: str | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Import the checkpoint at ``path`` into the store at ``root`` as ``run@step``.

    ``step`` defaults to the one the source records (HF ``trainer_state.json``
    ``global_step`` or the ``checkpoint-N`` folder name, Lightning's ``global_step``, a
    ``global_step``/``step`` key of a torch file). ``format`` forces ``hf``, ``lightning``,
    ``torch`` or ``safetensors``. ``trust=True`` allows full unpickling — UNSAFE for files
    from others. Everything is read and checked before the store is touched; the
    checkpoint becomes visible atomically, like any save.
    """
    validate_run_name(run)
    if step is not None:
        validate_step(step)
    imported = read_checkpoint(path, format=format, trust=trust)
    chosen = step if step is not None else imported.step
    if chosen is None:
        raise StepvaultError(
            f"{path}: the {imported.format} checkpoint records no step; pass step=N (--step N)"
        )
    validate_step(chosen)
    return commit_imported(root, imported, run=run, step=chosen, codec=codec, overwrite=overwrite)


def commit_imported(
    root: str | os.PathLike[str],
    imported: ImportedState,
    *,
    run: str,
    step: int,
    codec: str | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Write an :class:`ImportedState` as checkpoint ``run@step``."""
    arrays: dict[str, Any] = {}
    try:
        encoded = Encoder(arrays.__setitem__).encode(imported.tree)
    except UnsupportedTypeError as exc:
        raise UnsupportedTypeError(f"{imported.source}: {exc}") from None
    metadata = {
        "imported_from": imported.source,
        "format": imported.format,
        "files": list(imported.files),
        **imported.metadata,
    }
    if imported.missing:
        metadata["missing"] = dict(imported.missing)
    snapshot = Snapshot(encoded, dict(imported.kinds), arrays)
    manifest = new_manifest(
        run,
        step,
        snapshot,
        epoch=imported.epoch,
        metrics=imported.metrics or None,
        metadata=metadata,
    )
    host = {name: to_host(value) for name, value in arrays.items()}
    store = open_store_for_writing(root)
    add_attachments(store, manifest, imported.attachments)
    info = write_manifest(store, manifest, host, codec=codec, overwrite=overwrite)
    return ImportReport(
        run=run,
        step=step,
        format=imported.format,
        source=imported.source,
        entries=dict(imported.kinds),
        files=list(imported.files),
        skipped=list(imported.skipped),
        tensors=len(arrays),
        save=info,
        missing=dict(imported.missing),
        attachments=sorted(imported.attachments),
    )


def import_checkpoints(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int | None = None,
    format: Format | None = None,
    trust: bool = False,
    codec: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
) -> list[ImportReport]:
    """Like :func:`import_checkpoint`, and a Trainer ``output_dir`` imports every
    ``checkpoint-N`` folder in it, oldest first, as steps of ``run`` — chunks they share
    (frozen layers, unchanged embeddings) are stored once.

    Each folder is read completely before its checkpoint is written; if one fails, the
    ones before it stay imported (and the error names the failing folder).
    ``progress(done, total)`` gets the source bytes imported so far, after each checkpoint.
    """
    path = os.fspath(path)
    folders = (
        hf_checkpoint_folders(path)
        if os.path.isdir(path) and format in (None, "hf") and not is_hf_checkpoint(path)
        else []
    )
    sources = [folder for _, folder in folders] or [path]
    sizes = [_source_bytes(p) for p in sources]
    report = progress if progress is not None else (lambda done, total: None)
    report(0, sum(sizes))
    if not folders:
        out = [
            import_checkpoint(
                root,
                path,
                run=run,
                step=step,
                format=format,
                trust=trust,
                codec=codec,
                overwrite=overwrite,
            )
        ]
        report(sizes[0], sizes[0])
        return out
    if step is not None:
        raise StepvaultError(
            f"{path}: holds {len(folders)} checkpoint folders; step= applies to one "
            "checkpoint (import a single checkpoint-N folder to choose its step)"
        )
    reports = []
    for i, folder in enumerate(sources):
        reports.append(
            import_checkpoint(
                root, folder, run=run, format="hf", trust=trust, codec=codec, overwrite=overwrite
            )
        )
        report(sum(sizes[: i + 1]), sum(sizes))
    return reports


def _source_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a folder (what an import reads)."""
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
