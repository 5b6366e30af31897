"""A sharded checkpoint restored on one rank of a process group, in that process alone: the
restore planner's rule for a DDP rank (a rank-local manager, ``restore(collective=False)``,
a trainer integration's read on a rank other than zero) resuming an FSDP job's checkpoint.

Each rank reads the full tensors as one process reshards (DCP without a collective), takes
the per-rank values (RNG) the same rank saved, and verifies every object of a candidate
before placing a byte, so that every rank reaches the same verdict on damage and falls back
alike without a collective (:func:`restore_rank_local`; called by
:func:`stepvault.core.planner.restore_local`).
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

from ..errors import (
    CorruptObjectError,
    IntegrityError,
    NoValidCheckpointError,
    StateMismatchError,
    StoreVersionError,
)
from ..format import Manifest, decode_value
from ..store import Store
from .info import RestoreInfo, SkippedCheckpoint
from .planner import RestorePlanner, Source

__all__ = ["restore_rank_local"]


def restore_rank_local(
    source: Source,
    state: MutableMapping[str, Any],
    offer: Any,
    *,
    strict: bool = True,
    workers: int | None = None,
) -> RestoreInfo:
    """Under a process group, in this process alone: the first candidate of ``offer``
    (an :class:`~stepvault.distributed.agreement.Offer`) that fits and verifies, read the
    way one process reshards a checkpoint several ranks wrote (DCP without a collective:
    this rank reads the full tensors). What a DDP rank needs from an FSDP job's
    checkpoint: the whole model and optimizer state.

    Per-rank values are this rank's: the RNG state saved by the same rank where the
    checkpoint has one; a rank it lacks (2 FSDP ranks -> 4 DDP ranks) keeps its own RNG,
    with a warning. Plain values are the ones every rank saved alike (rank 0's).

    The ranks agree without a collective: before placing a byte each rank verifies
    *every* object of a sharded candidate (every rank's shards and RNG, not only what it
    reads), so damage anywhere is seen by every rank alike and every rank falls back to
    the same candidate; a rank that reads exactly the step another rank chose (the DDP
    integrations' ranks != 0) finds the same verdict. A candidate one process wrote is
    restored by :class:`RestorePlanner`.
    """
    from ..distributed.restoring import restore_checkpoint
    from ..format import parse_manifest

    t0 = time.perf_counter()
    store, run = source.store, source.run
    skipped: list[SkippedCheckpoint] = []
    for i, candidate in enumerate(offer.steps):
        one_process = False  # RestorePlanner quarantines the damage it finds itself
        try:
            first = offer.first if i == 0 else None
            manifest = (
                first
                if isinstance(first, Manifest)
                else parse_manifest(store.read_manifest(run, candidate), f"{run}@{candidate}")
            )
            if not manifest.sharded:
                one_process = True
                info = RestorePlanner(store, run, workers=workers).restore(
                    state, [candidate], fallback=False, strict=strict
                )
                info.skipped = skipped + info.skipped
                return info
            _check_live_slots(manifest, state)
            _verify_sharded(store, manifest, workers)
            restore_checkpoint(
                store, state, run, candidate, manifest, workers=workers, strict=strict, local=True
            )
        except (IntegrityError, StoreVersionError) as exc:
            reason = str(exc)
            if isinstance(exc, CorruptObjectError) and exc.digest and not one_process:
                # a damaged object must not be "deduplicated" into future checkpoints
                reason += f" (object moved to {store.quarantine_object(exc.digest)})"
            if not offer.fallback:
                raise
            skipped.append(SkippedCheckpoint(candidate, reason))
            continue
        metadata = decode_value(manifest.metadata, lambda kind, name: None)
        return RestoreInfo.of_manifest(manifest, metadata, skipped, time.perf_counter() - t0)
    reasons = "\n  ".join(f"{s.step}: {s.reason}" for s in skipped)
    raise NoValidCheckpointError(
        f"no checkpoint of run {run!r} verifies; tried {len(skipped)}:\n  {reasons}", skipped
    )


def _check_live_slots(manifest: Manifest, state: MutableMapping[str, Any]) -> None:
    """A sharded checkpoint restores into live objects: an empty slot (None) where it holds
    tensors is refused before anything is read (a holder that a reader fills from a
    one-process checkpoint's saved tree cannot take DCP's tensors)."""
    entries = (manifest.sharded or {}).get("entries", {})
    empty = sorted(
        key
        for key, value in state.items()
        if value is None
        and any(
            fqn.startswith(f"{key}.") and e.get("type") != "value" for fqn, e in entries.items()
        )
    )
    if empty:
        raise StateMismatchError(
            [
                f"{manifest.run}@{manifest.step} was written by several ranks (a sharded "
                f"job) and restores into live objects, but state[{k!r}] is empty (None). "
                "Pass the live module/optimizer; or resume it with the sharding strategy "
                "(any number of ranks: the restore reshards), or load its weights in one "
                "process (stepvault.restore(root, {'model': model}, run=..., step=..., "
                "strict=False), or `stepvault export`)"
                for k in empty
            ]
        )


def _verify_sharded(store: Store, manifest: Manifest, workers: int | None) -> None:
    """Read and verify every object of a sharded checkpoint (every rank's shards)."""
    from ..engine import CheckpointReader

    digests = {
        chunk[0]
        for entry in (manifest.sharded or {}).get("entries", {}).values()
        if entry.get("type") != "value"
        for shard in entry.get("shards", [])
        for chunk in shard["chunks"]
    }
    reader = CheckpointReader(store, manifest, workers=workers)
    try:
        reader.prefetch(iter(sorted(digests)))
    finally:
        reader.release()
