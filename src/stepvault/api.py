"""The functional API: ``save``, ``restore`` and ``open``.

These are the building blocks the :class:`CheckpointManager` (policies, async, retention)
is made of; they are complete on their own for scripts and tools.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ._env import environment
from .engine import CheckpointReader, to_host, write_checkpoint
from .errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    IntegrityError,
    NoValidCheckpointError,
    StoreVersionError,
    UnsupportedTypeError,
)
from .format import CODEC_CHOICES, Encoder, Manifest, decode_value, parse_manifest
from .format.chunking import DEFAULT_BUNDLE_SIZE, DEFAULT_CHUNK_SIZE, DEFAULT_SMALL_TENSOR
from .ops import StoreUsage, VerifyReport, store_usage, verify_store
from .state import apply, capture
from .store import Store, backend_for, validate_run_name, validate_step
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
) -> SaveInfo:
    """Save ``state`` as checkpoint ``run@step`` in the store at ``root`` (created if absent).

    ``state`` maps names to modules, optimizers, schedulers, any object with
    ``state_dict()/load_state_dict()``, tensors, numpy arrays and plain values. Everything is
    checked for safe encodability *before* a byte is written; chunks already in the store
    are not written again. The checkpoint becomes visible atomically when its manifest is
    committed; a failed save leaves every earlier checkpoint intact.

    ``codec`` overrides the store's setting for this save: ``raw``, ``zstd``, ``float`` or
    ``auto``. With ``overwrite=True`` an existing checkpoint of the same step is replaced
    atomically (otherwise :class:`CheckpointExistsError`).
    """
    validate_run_name(run)
    validate_step(step)
    if epoch is not None:
        validate_step(epoch)
    if codec is not None and codec not in CODEC_CHOICES:
        raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {codec!r}")
    tree, kinds = capture(state)
    arrays: dict[str, Any] = {}
    encoded = Encoder(lambda name, value: arrays.__setitem__(name, value)).encode(tree)
    manifest = Manifest(
        run=run,
        step=step,
        created=time.time(),
        epoch=epoch,
        kind=kind,
        metrics=_encode_metrics(metrics),
        metadata=_encode_metadata(metadata),
        state=encoded,
        state_kinds=kinds,
        environment=environment(),
    )
    host = {name: to_host(value) for name, value in arrays.items()}
    store = Store.open(root, create=True, defaults=DEFAULT_STORE_SETTINGS)
    earlier = [s for s in store.list_steps(run) if s < step]
    manifest.parent_step = earlier[-1] if earlier else None
    store.ensure_run(run, {"run": run, "created": manifest.created, "environment": environment()})
    stats = write_checkpoint(
        store,
        manifest,
        host,
        codec=codec or store.settings.get("codec", "raw"),
        overwrite=overwrite,
        workers=workers,
    )
    return SaveInfo(
        run=run,
        step=step,
        epoch=epoch,
        logical_bytes=stats.logical_bytes,
        stored_bytes=stats.stored_bytes,
        new_bytes=stats.new_bytes,
        objects=stats.objects,
        new_objects=stats.new_objects,
        seconds=stats.seconds,
    )


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


def restore(
    root: Root,
    state: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    strict: bool = True,
    missing_ok: bool = False,
    workers: int | None = None,
) -> RestoreInfo | None:
    """Load checkpoint ``run@step`` into the live objects of ``state``.

    ``step="latest"`` takes the newest committed checkpoint that verifies completely; a
    damaged one is reported in ``RestoreInfo.skipped`` and the next older one is tried. An
    explicit step never falls back. A damaged object is moved to ``quarantine/`` so that
    no later save deduplicates against it. Everything is read and verified, and the checkpoint is
    checked against the live state (keys, shapes, dtypes, types), before anything in
    ``state`` is changed: a failed restore leaves the training state as it was.

    Returns None when the run has no checkpoint and ``missing_ok`` is true (a fresh start).
    """
    t0 = time.perf_counter()
    validate_run_name(run)
    try:
        store = Store.open(root)
    except Exception:
        if missing_ok and not backend_for(root).exists("stepvault.json"):
            return None
        raise
    steps = store.list_steps(run)
    if step == "latest":
        candidates = list(reversed(steps))
        if not candidates:
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"run {run!r} has no committed checkpoint in {store.backend.url} "
                f"(runs: {', '.join(store.list_runs()) or 'none'})"
            )
    else:
        candidates = [validate_step(step)]
    skipped: list[SkippedCheckpoint] = []
    for candidate in candidates:
        try:
            manifest, tree, nbytes = load_verified(store, run, candidate, workers=workers)
        except (IntegrityError, StoreVersionError) as exc:
            reason = str(exc)
            if isinstance(exc, CorruptObjectError) and exc.digest:
                # A damaged object must not be "deduplicated" into future checkpoints.
                reason += f" (object moved to {store.quarantine_object(exc.digest)})"
            if step != "latest":
                raise
            skipped.append(SkippedCheckpoint(candidate, reason))
            continue
        apply(state, tree, manifest.state_kinds, strict=strict)
        metadata = decode_value(manifest.metadata, lambda kind, name: None)
        return RestoreInfo(
            run=run,
            step=manifest.step,
            epoch=manifest.epoch,
            metrics=dict(manifest.metrics),
            metadata=metadata,
            created=manifest.created,
            skipped=skipped,
            seconds=time.perf_counter() - t0,
            bytes_read=nbytes,
        )
    reasons = "\n  ".join(f"{s.step}: {s.reason}" for s in skipped)
    raise NoValidCheckpointError(
        f"no checkpoint of run {run!r} verifies; tried {len(skipped)}:\n  {reasons}", skipped
    )


def open(root: Root) -> Vault:
    """Open the store at ``root`` for reading: runs, checkpoints, manifests, lazy tensors."""
    return Vault(Store.open(root))


def verify(
    root: Root,
    run: str | None = None,
    step: int | None = None,
    *,
    deep: bool = False,
    workers: int | None = None,
) -> VerifyReport:
    """Check checkpoints: quick (objects present, sizes right) or ``deep`` (re-hash all)."""
    if run is not None:
        validate_run_name(run)
    return verify_store(Store.open(root), run=run, step=step, deep=deep, workers=workers)


def usage(root: Root) -> StoreUsage:
    """Logical vs stored bytes of the store, with dedup and compression savings."""
    return store_usage(Store.open(root))
