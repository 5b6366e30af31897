"""The functional API: ``save``, ``restore`` and ``open``.

These are the building blocks the :class:`CheckpointManager` (policies, async, retention)
is made of; they are complete on their own for scripts and tools.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ._env import environment
from .engine import CheckpointReader, HostArray, PendingArray, to_host, write_checkpoint
from .engine.attachments import add_attachments
from .errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    IntegrityError,
    ManifestError,
    NoValidCheckpointError,
    StateMismatchError,
    StepvaultError,
    StoreNotFoundError,
    StoreVersionError,
    UnsupportedTypeError,
)
from .format import CODEC_CHOICES, Encoder, Manifest, decode_value, parse_manifest
from .format.chunking import DEFAULT_BUNDLE_SIZE, DEFAULT_CHUNK_SIZE, DEFAULT_SMALL_TENSOR
from .lineage import Lineage, write_lineage
from .state import apply, validate
from .state.placement import place_and_materialize
from .state.snapshot import Snapshot, take_snapshot
from .store import Store, validate_run_name, validate_step
from .store.signing import Signer
from .vault import Vault

#: Settings recorded in ``stepvault.json`` when a store is created by ``save``.
DEFAULT_STORE_SETTINGS: dict[str, Any] = {
    "chunk_size": DEFAULT_CHUNK_SIZE,
    "small_tensor": DEFAULT_SMALL_TENSOR,
    "bundle_size": DEFAULT_BUNDLE_SIZE,
    # The hot tier favours speed: raw chunks are memory-mapped on restore. Use "auto" for
    # the float codec on fp16/bf16/fp32 and zstd elsewhere.
    "codec": "raw",
}

Root = str | os.PathLike[str]


@dataclass(frozen=True)
class SaveInfo:
    """What one save wrote."""

    run: str
    step: int
    epoch: int | None
    logical_bytes: int
    stored_bytes: int
    new_bytes: int
    objects: int
    new_objects: int
    seconds: float
    kind: str = "full"

    @property
    def throughput(self) -> float:
        """Logical bytes per second of this save."""
        return self.logical_bytes / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class SkippedCheckpoint:
    step: int
    reason: str


@dataclass
class RestoreInfo:
    """What a restore loaded, and which newer checkpoints it skipped and why."""

    run: str
    step: int
    epoch: int | None
    metrics: dict[str, float]
    metadata: Any
    created: float
    kind: str = "full"
    skipped: list[SkippedCheckpoint] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0


def _encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise UnsupportedTypeError(f"metric names must be str, got {k!r}")
        if isinstance(v, torch.Tensor | np.ndarray | np.generic):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise UnsupportedTypeError(f"metric {k!r} must be a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            raise UnsupportedTypeError(f"metric {k!r} is {v}; metrics must be finite numbers")
        out[k] = v
    return out


def _encode_metadata(metadata: Any) -> Any:
    def no_arrays(name: str, value: Any) -> None:
        raise UnsupportedTypeError(
            f"metadata[{name!r}] is a tensor/array; put tensors in the state, not metadata"
        )

    return None if metadata is None else Encoder(no_arrays).encode(metadata, ("metadata",))


def _collective(state: Mapping[str, Any], collective: bool | None) -> bool:
    """Whether a save/restore must run on every rank through DCP."""
    from .distributed.state import distributed_active, has_dtensor

    sharded = has_dtensor(state)
    if collective is False:
        if sharded:
            raise StepvaultError(
                "the state holds sharded DTensors (FSDP2 / tensor parallel): a save from one "
                "rank would keep only that rank's shards. Call stepvault.save on every rank "
                "(leave collective unset)"
            )
        return False
    return bool(collective) or sharded or distributed_active()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def new_manifest(
    run: str,
    step: int,
    snapshot: Snapshot,
    *,
    epoch: int | None = None,
    kind: str = "full",
    metrics: Mapping[str, Any] | None = None,
    metadata: Any = None,
    lineage: str | None = None,
) -> Manifest:
    """A manifest for ``snapshot`` (tensor and object tables are filled by the writer)."""
    validate_run_name(run)
    validate_step(step)
    if epoch is not None:
        validate_step(epoch)
    return Manifest(
        run=run,
        step=step,
        created=time.time(),
        epoch=epoch,
        kind=kind,
        metrics=_encode_metrics(metrics),
        metadata=_encode_metadata(metadata),
        state=snapshot.state,
        state_kinds=snapshot.kinds,
        environment=environment(),
        lineage=lineage,
    )


def open_store_for_writing(root: Root | Store) -> Store:
    """The store at ``root``, created with the default settings when absent."""
    if isinstance(root, Store):
        return root
    return Store.open(root, create=True, defaults=DEFAULT_STORE_SETTINGS)


def write_manifest(
    store: Store,
    manifest: Manifest,
    host: dict[str, HostArray],
    *,
    codec: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
) -> SaveInfo:
    """Write the staged tensors of one checkpoint and commit its manifest."""
    if codec is not None and codec not in CODEC_CHOICES:
        raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {codec!r}")
    earlier = [s for s in store.list_steps(manifest.run) if s < manifest.step]
    manifest.parent_step = earlier[-1] if earlier else None
    store.ensure_run(
        manifest.run,
        {"run": manifest.run, "created": manifest.created, "environment": environment()},
    )
    stats = write_checkpoint(
        store,
        manifest,
        host,
        codec=codec or store.settings.get("codec", "raw"),
        overwrite=overwrite,
        workers=workers,
    )
    return SaveInfo(
        run=manifest.run,
        step=manifest.step,
        epoch=manifest.epoch,
        logical_bytes=stats.logical_bytes,
        stored_bytes=stats.stored_bytes,
        new_bytes=stats.new_bytes,
        objects=stats.objects,
        new_objects=stats.new_objects,
        seconds=stats.seconds,
        kind=manifest.kind,
    )


def save(
    root: Root,
    state: Mapping[str, Any],
    *,
    run: str,
    step: int,
    epoch: int | None = None,
    metadata: Any = None,
    metrics: Mapping[str, Any] | None = None,
    kind: str = "full",
    codec: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    collective: bool | None = None,
    lineage: Lineage | None = None,
    signer: Signer | None = None,
    attachments: Mapping[str, Any] | None = None,
) -> SaveInfo:
    """Save ``state`` as checkpoint ``run@step`` in the store at ``root`` (created if absent).

    ``state`` maps names to modules, optimizers, schedulers, any object with
    ``state_dict()/load_state_dict()``, tensors, numpy arrays and plain values. Everything is
    checked for safe encodability *before* a byte is written; chunks already in the store
    are not written again. The checkpoint becomes visible atomically when its manifest is
    committed; a failed save leaves every earlier checkpoint intact.

    ``kind="weights"`` keeps only the modules of the state (for export or evaluation).
    ``codec`` overrides the store's setting for this save: ``raw``, ``zstd``, ``float`` or
    ``auto``. With ``overwrite=True`` an existing checkpoint of the same step is replaced
    atomically (otherwise :class:`CheckpointExistsError`).

    Under a ``torch.distributed`` process group (or with sharded DTensor state) every rank
    calls ``save`` with its own shards; each rank writes its part and rank 0 commits once
    all succeeded (``collective=None`` decides automatically; ``collective=False`` saves a
    replicated model from one rank and refuses sharded state).

    ``lineage`` (a :class:`stepvault.Lineage`, e.g. ``Lineage.capture(config)``) is stored
    with the run and linked from the manifest; ``signer`` signs the manifest (default:
    ``$STEPVAULT_SIGNING_KEY`` when set). ``attachments`` maps file names to bytes or file
    paths (``{"config.json": "out/config.json"}``): small files stored with the checkpoint
    (see :mod:`stepvault.engine.attachments`).
    """
    t0 = time.perf_counter()
    if codec is not None and codec not in CODEC_CHOICES:
        raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {codec!r}")
    validate_run_name(run)
    lineage_digest = None
    if lineage is not None or signer is not None:
        store = open_store_for_writing(root)
        if signer is not None:
            store.signer = signer
        if lineage is not None and _rank() == 0:
            lineage_digest = write_lineage(store, run, lineage)
        root = store
    if _collective(state, collective):
        from .distributed.api import save_state

        if attachments:  # issue 19: attachments are written by single-process saves only
            raise ValueError("attachments are not supported by multi-rank saves yet")

        save_state(
            root,
            state,
            run=run,
            step=step,
            epoch=epoch,
            metrics=_encode_metrics(metrics),
            codec=codec,
            workers=workers,
            lineage=lineage_digest,
        )
        committed = root if isinstance(root, Store) else Store.open(root)
        m = parse_manifest(committed.read_manifest(run, step), f"{run}@{step}")
        return SaveInfo(
            run,
            step,
            epoch,
            m.logical_bytes,
            m.stored_bytes,
            int(m.stats.get("new_bytes", 0)),
            len(m.objects),
            0,
            time.perf_counter() - t0,
            m.kind,
        )
    snapshot = take_snapshot(state, kind=kind)
    manifest = new_manifest(
        run,
        step,
        snapshot,
        epoch=epoch,
        kind=kind,
        metrics=metrics,
        metadata=metadata,
        lineage=lineage_digest,
    )
    host = {name: to_host(value) for name, value in snapshot.arrays.items()}
    store = open_store_for_writing(root)
    add_attachments(store, manifest, attachments)  # issue 19: attachments
    info = write_manifest(store, manifest, host, codec=codec, overwrite=overwrite, workers=workers)
    return dataclasses.replace(info, seconds=time.perf_counter() - t0)


def _open_checkpoint(
    store: Store, run: str, step: int, workers: int | None
) -> tuple[Manifest, CheckpointReader, dict[str, Any]]:
    """Parse a manifest; return it, a reader, and its state with meta stand-in tensors."""
    manifest = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    reader = CheckpointReader(store, manifest, workers=workers)

    def stand_in(kind: str, name: str) -> Any:
        entry = manifest.tensors.get(name)
        if entry is None or entry.kind != kind:
            raise ManifestError(f"state references unknown {kind} {name!r}")
        return reader.meta(name)

    return manifest, reader, decode_value(manifest.state, stand_in)


def load_verified(
    store: Store, run: str, step: int, *, workers: int | None = None
) -> tuple[Manifest, dict[str, Any], int]:
    """Read one checkpoint completely and verify every object; ``(manifest, tree, bytes)``.

    Raises an :class:`IntegrityError` (or :class:`StoreVersionError`) on any damage.
    """
    manifest = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    reader = CheckpointReader(store, manifest, workers=workers)
    arrays = reader.read_all()
    tree = decode_value(manifest.state, lambda kind, name: _pick(arrays, kind, name))
    return manifest, tree, manifest.logical_bytes


def _pick(arrays: dict[str, Any], kind: str, name: str) -> Any:
    from .errors import ManifestError

    try:
        value = arrays[name]
    except KeyError:
        raise ManifestError(f"state references unknown tensor {name!r}") from None
    is_tensor = isinstance(value, torch.Tensor)
    if (kind == "tensor") != is_tensor:
        raise ManifestError(f"state references {name!r} as {kind}, stored otherwise")
    return value


def restore_candidates(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    candidates: list[int],
    *,
    fallback: bool,
    strict: bool = True,
    workers: int | None = None,
    full_only: bool = False,
) -> RestoreInfo:
    """Restore the first of ``candidates`` that verifies (all of them tried if ``fallback``).

    ``full_only`` passes over weights-only checkpoints (they cannot restore a training state
    with an optimizer, step or RNG; they are not damaged, so not reported as skipped).
    """
    t0 = time.perf_counter()
    skipped: list[SkippedCheckpoint] = []
    weights_only_steps: list[int] = []
    for candidate in candidates:
        try:
            manifest, reader, meta_tree = _open_checkpoint(store, run, candidate, workers)
            if full_only and manifest.kind != "full":
                reader.release()
                weights_only_steps.append(candidate)
                continue
            # A checkpoint that does not fit the live state is the caller's mistake, not
            # damage: report it before reading a byte, and never fall back past it.
            problems = validate(state, meta_tree, manifest.state_kinds, strict=strict)
            if problems:
                raise StateMismatchError(problems)
            reader.prefetch(d for t in manifest.tensors.values() for d, _, _ in t.chunks)
            nbytes = manifest.logical_bytes
        except (IntegrityError, StoreVersionError) as exc:
            reason = str(exc)
            if isinstance(exc, CorruptObjectError) and exc.digest:
                # A damaged object must not be "deduplicated" into future checkpoints.
                reason += f" (object moved to {store.quarantine_object(exc.digest)})"
            if not fallback:
                raise
            skipped.append(SkippedCheckpoint(candidate, reason))
            continue
        # Every object is verified and the state fits: only now is live state touched.
        pending = decode_value(manifest.state, PendingArray)
        tree = place_and_materialize(state, pending, reader)
        reader.release()
        apply(state, tree, manifest.state_kinds, strict=strict, validated=True)
        metadata = decode_value(manifest.metadata, lambda kind, name: None)
        return RestoreInfo(
            run=run,
            step=manifest.step,
            epoch=manifest.epoch,
            metrics=dict(manifest.metrics),
            metadata=metadata,
            created=manifest.created,
            kind=manifest.kind,
            skipped=skipped,
            seconds=time.perf_counter() - t0,
            bytes_read=nbytes,
        )
    if weights_only_steps and not skipped:
        raise NoValidCheckpointError(
            f"run {run!r} has only weights-only checkpoints ({weights_only_steps[:5]}...), "
            "which cannot restore a training state; restore the modules alone "
            "({'model': model}) or save full checkpoints"
        )
    reasons = "\n  ".join(f"{s.step}: {s.reason}" for s in skipped)
    raise NoValidCheckpointError(
        f"no checkpoint of run {run!r} verifies; tried {len(skipped)}:\n  {reasons}", skipped
    )


def restore(
    root: Root,
    state: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    strict: bool = True,
    missing_ok: bool = False,
    workers: int | None = None,
    collective: bool | None = None,
) -> RestoreInfo | None:
    """Load checkpoint ``run@step`` into the live objects of ``state``.

    ``step="latest"`` takes the newest committed checkpoint that verifies completely; a
    damaged one is reported in ``RestoreInfo.skipped`` and the next older one is tried. An
    explicit step never falls back. A damaged object is moved to ``quarantine/`` so that
    no later save deduplicates against it. Everything is read and verified, and the
    checkpoint is checked against the live state (keys, shapes, dtypes, types), before
    anything in ``state`` is changed: a failed restore leaves the training state as it was.

    Returns None when the run has no checkpoint and ``missing_ok`` is true (a fresh start).
    Under a process group every rank calls it; a checkpoint saved on N ranks loads on M.
    """
    validate_run_name(run)
    if _collective(state, collective):
        return _restore_collective(root, state, run, step, missing_ok, workers)
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    from .tiers.view import read_view, read_workers, with_copies

    store = read_view(store)  # a store with cold tiers restores from any tier, hot first
    workers = workers or read_workers(store)  # many parallel fetches from object stores
    steps = store.list_steps(run)
    newest = steps[-1] if step == "latest" and steps else step
    if isinstance(newest, int) and _is_sharded(store, run, newest):
        return _restore_collective(store, state, run, step, missing_ok, workers)
    if step == "latest":
        if not steps:
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"run {run!r} has no committed checkpoint in {store.backend.url} "
                f"(runs: {', '.join(store.list_runs()) or 'none'})"
            )
        return restore_candidates(
            store,
            state,
            run,
            with_copies(store, run, list(reversed(steps))),  # a damaged copy: another tier's
            fallback=True,
            strict=strict,
            workers=workers,
            # like the manager: "latest" of a training state is the newest *full* checkpoint
            full_only=any(not isinstance(v, torch.nn.Module) for v in state.values()),
        )
    explicit = with_copies(store, run, [validate_step(step)])  # the same step, any tier
    return restore_candidates(
        store, state, run, explicit, fallback=len(explicit) > 1, strict=strict, workers=workers
    )


def _is_sharded(store: Store, run: str, step: int) -> bool:
    """Whether ``run@step`` was written by a distributed save (read it through DCP)."""
    try:
        return bool(parse_manifest(store.read_manifest(run, step), f"{run}@{step}").sharded)
    except StepvaultError:
        return False  # damaged or absent: the normal path reports it (and falls back)


def _restore_collective(root, state, run, step, missing_ok, workers) -> RestoreInfo | None:
    from .distributed.api import restore_state

    t0 = time.perf_counter()
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    if step == "latest" and not store.list_steps(run):
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"run {run!r} has no committed checkpoint")
    chosen = restore_state(store, state, run=run, step=step, workers=workers)
    m = parse_manifest(store.read_manifest(run, chosen), f"{run}@{chosen}")
    return RestoreInfo(
        run,
        chosen,
        m.epoch,
        dict(m.metrics),
        m.metadata,
        m.created,
        m.kind,
        seconds=time.perf_counter() - t0,
        bytes_read=m.logical_bytes,
    )


def annotate(
    root: Root | Store,
    run: str,
    step: int,
    metrics: Mapping[str, Any],
    *,
    note: str = "",
    signer: Signer | None = None,
) -> dict[str, Any]:
    """Attach evaluation ``metrics`` to checkpoint ``run@step`` after the fact.

    The record is bound to that exact manifest; keep policies (``KeepBest``) and
    ``restore(step="best")`` use the newest annotated value of each metric. Returns the
    stored record (time, user, host, metrics).
    """
    from .store.annotations import write_annotation
    from .store.events import log_event

    store = root if isinstance(root, Store) else Store.open(root)
    record = write_annotation(store, run, step, dict(metrics), note=note, signer=signer)
    log_event(store, run, "annotate", step=step, metrics=record["metrics"], note=note)
    return record


def open(root: Root) -> Vault:
    """Open the store at ``root`` for reading: runs, checkpoints, manifests, lazy tensors
    (of every tier, when the store has cold tiers: see STORAGE.md)."""
    from .tiers.view import read_view

    return Vault(read_view(Store.open(root)))
