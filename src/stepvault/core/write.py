"""The save path of the core: a snapshot becomes a manifest, its objects and a commit.

``save`` (the function behind :func:`stepvault.save`) is snapshot → :func:`new_manifest`
→ host copies → :func:`write_manifest`; the manager runs the same steps with its own
staging buffers and a background thread in between (ARCHITECTURE.md, "The save path").
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from .._env import environment
from .._rank import current_rank
from ..catalog import commit as epilogue
from ..catalog.attachments import add_attachments
from ..catalog.lineage import Lineage, write_lineage
from ..engine import HostArray, to_host, write_checkpoint
from ..engine.parent import find_parent
from ..engine.writer import ChunkDigests
from ..format import CODEC_CHOICES, Manifest, parse_manifest
from ..format.settings import DEFAULT_STORE_SETTINGS
from ..state.snapshot import Snapshot, take_snapshot
from ..store import Store, validate_run_name, validate_step
from ..store.signing import Signer
from .info import SaveInfo
from .light import LightOptions
from .scope import is_collective
from .values import encode_metadata, encode_metrics

Root = str | os.PathLike[str]


def check_codec(codec: str | None) -> str | None:
    """``codec`` if it names a codec (or is None); else a ValueError naming the choices."""
    if codec is not None and codec not in CODEC_CHOICES:
        raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {codec!r}")
    return codec


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
        metrics=encode_metrics(metrics),
        metadata=encode_metadata(metadata),
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
    parent: Manifest | None = None,
    digests: ChunkDigests | None = None,
    after_commit: Callable[[Manifest, bytes], None] | None = None,
) -> SaveInfo:
    """Write the staged tensors of one checkpoint and commit its manifest.

    ``digests`` shares the chunk digests of ``host`` with the save's other destinations
    (each chunk hashed once per save); ``after_commit(manifest, data)`` gets the manifest
    bytes as committed (so nobody reads them back).

    The manifest's parent is the run's newest earlier checkpoint, found from the writer's
    own last commit (``parent``, else the one this process remembers; see
    :mod:`stepvault.engine.parent`); chunks that the parent already names are reused from
    its object table (one touch each, no size or header lookups).
    """
    check_codec(codec)
    # The writer's own last commit, not a listing of the run (engine/parent.py).
    manifest.parent_step, known = find_parent(store, manifest.run, manifest.step, parent)
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
        known=known,
        before_commit=_before_commit(store, manifest),
        after_commit=_after_commit(store, after_commit),  # listings find it
        digests=digests,
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


def _after_commit(
    store: Store, then: Callable[[Manifest, bytes], None] | None
) -> Callable[[Manifest, bytes], None]:
    """Right after the commit: the epilogue's summary row (``catalog/commit.py``), then
    the caller's ``then``."""

    def run(m: Manifest, data: bytes) -> None:
        epilogue.after_commit(store, m, data)
        if then is not None:
            then(m, data)

    return run


def _before_commit(store: Store, manifest: Manifest) -> Callable[[], None]:
    """Right before the commit, the epilogue every save shares (``catalog/commit.py``): a
    light checkpoint names its base's chunks, then every reused delta object's bases are
    listed (so GC keeps them)."""
    light = _light_commit(store, manifest)
    return lambda: epilogue.before_commit(store, manifest, light=light)


def _light_commit(store: Store, manifest: Manifest) -> Callable[[], None] | None:
    """What a light checkpoint does right before its commit: name the base's chunks."""
    if manifest.light is None:
        return None
    from .light import adopt_base_tensors

    return lambda: adopt_base_tensors(store, manifest)


def _light_as_full(store: Store, run: str, step: int) -> None:
    """The run's event log records that a light save under a group was written full."""
    from ..catalog.events import log_event

    try:
        log_event(store, run, "light_as_full", step=step, reason="multi-rank saves are always full")
    except OSError:
        pass  # the log is a record, never a reason to fail a save


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
    lineage: Lineage | Literal[False] | None = None,
    signer: Signer | None = None,
    attachments: Mapping[str, Any] | None = None,
    light: LightOptions | None = None,
) -> SaveInfo:
    """Save ``state`` as checkpoint ``run@step`` in the store at ``root`` (created if absent).

    ``state`` maps names to modules, optimizers, schedulers, any object with
    ``state_dict()/load_state_dict()``, tensors, numpy arrays and plain values. Everything is
    checked for safe encodability *before* a byte is written; chunks already in the store
    are not written again. The checkpoint becomes visible atomically when its manifest is
    committed; a failed save leaves every earlier checkpoint intact.

    ``kind="weights"`` keeps only the modules of the state (for export or evaluation).
    ``kind="light"`` stores the float tensors as quantised deltas against the run's newest
    full checkpoint, lossy, with the measured error in the manifest (``light`` configures
    it: :class:`stepvault.core.light.LightOptions`); without a full checkpoint yet it saves
    a full one (``SaveInfo.kind`` and the event log say so), and so does a light save under
    a process group (light checkpoints need one process; a one-time RuntimeWarning says so).
    ``codec`` overrides the store's setting for this save: ``raw``, ``zstd``, ``float`` or
    ``auto``. With ``overwrite=True`` an existing checkpoint of the same step is replaced
    atomically (otherwise :class:`CheckpointExistsError`).

    Under a ``torch.distributed`` process group (or with sharded DTensor state) every rank
    calls ``save`` with its own shards; each rank writes its part and rank 0 commits once
    all succeeded (``collective=None`` decides automatically; ``collective=False`` saves a
    replicated model from one rank and refuses sharded state).

    ``lineage`` (a :class:`stepvault.registry.Lineage`, e.g. ``Lineage.capture(config)``) is stored
    with the run and linked from the manifest (``None`` or ``False``: none, as with the
    manager's ``lineage=False``); ``signer`` signs the manifest (default:
    ``$STEPVAULT_SIGNING_KEY`` when set). ``attachments`` maps file names to bytes or file
    paths (``{"config.json": "out/config.json"}``): small files stored with the checkpoint
    (see :mod:`stepvault.catalog.attachments`).
    """
    t0 = time.perf_counter()
    check_codec(codec)
    validate_run_name(run)
    target: Root | Store = root
    lineage_digest = None
    if lineage is False:  # the manager's spelling of "record no lineage"
        lineage = None
    if lineage is not None and not isinstance(lineage, Lineage):
        raise TypeError(
            f"lineage must be a stepvault.registry.Lineage (e.g. Lineage.capture(config)), None or "
            f"False, not {type(lineage).__name__}"
        )
    if lineage is not None or signer is not None:
        store = open_store_for_writing(root)
        if signer is not None:
            store.signer = signer
        if lineage is not None and current_rank() == 0:
            lineage_digest = write_lineage(store, run, lineage)
        target = store
    if is_collective(state, collective):
        from ..distributed.api import collective_kind, save_state

        # The manager's rule too: a light save under a group is written full (warned once).
        as_full = collective_kind(kind) != kind

        if attachments:
            raise ValueError(
                "attachments are not supported by multi-rank saves yet: save them from one "
                "process (stepvault attach RUN@STEP FILE after the save)"
            )
        save_state(
            target,
            state,
            run=run,
            step=step,
            epoch=epoch,
            metrics=encode_metrics(metrics),
            codec=codec,
            workers=workers,
            lineage=lineage_digest,
            metadata=encode_metadata(metadata),
        )
        committed = target if isinstance(target, Store) else Store.open(target)
        if as_full and current_rank() == 0:
            _light_as_full(committed, run, step)
        m = parse_manifest(committed.read_manifest(run, step), f"{run}@{step}")
        return SaveInfo.of_manifest(m, time.perf_counter() - t0)
    snapshot = take_snapshot(state, kind="full" if kind == "light" else kind)
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
    store = open_store_for_writing(target)
    arrays = snapshot.arrays
    if kind == "light":
        from .light import light_arrays

        arrays = light_arrays(store, manifest, snapshot, light)
    host = {name: to_host(value) for name, value in arrays.items()}
    add_attachments(store, manifest, attachments)
    info = write_manifest(store, manifest, host, codec=codec, overwrite=overwrite, workers=workers)
    return dataclasses.replace(info, seconds=time.perf_counter() - t0)
