"""How the ranks of a process group agree, for a collective save or restore.

Every rank must reach the call (:func:`handshake`); rank 0 chooses the restore candidates
and reads the first one's manifest, and every rank gets both in one broadcast
(:func:`share_offer`, an :class:`Offer`); the ranks try the candidates in that order and
fall back together (:func:`try_candidates`); damage anywhere, or a live state that does not
fit on any rank, is agreed on before any rank places a byte (:func:`agree`,
:func:`agree_fits`). The save side (:mod:`.api`) and the restore side (:mod:`.restoring`)
share these, and so does the core's restore planner.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._rank import current_rank, world_size
from ..errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    IntegrityError,
    ManifestError,
    NoValidCheckpointError,
    StateMismatchError,
    StepvaultError,
)
from ..format import Manifest
from ..format.settings import DEFAULT_STORE_SETTINGS
from ..store import Store

__all__ = [
    "Offer",
    "agree",
    "agree_fits",
    "c10d_tag",
    "group_store",
    "handshake",
    "share_offer",
    "try_candidates",
]


def group_store(root: str | os.PathLike[str] | Store, create: bool) -> Store:
    """The store at ``root`` on every rank; with ``create``, rank 0 creates it first and
    every rank waits for it (a barrier) before opening it."""
    if isinstance(root, Store):
        return root
    if create and current_rank() == 0:
        Store.open(root, create=True, defaults=DEFAULT_STORE_SETTINGS)
    if create and dist.is_initialized():
        dist.barrier()  # the store exists before any other rank opens it
    return Store.open(root)


_CALLS = {"n": 0}


def c10d_tag(what: str) -> str:
    """A key prefix in the c10d store unique to this collective call: every rank makes
    the same calls in the same order, so every rank numbers them alike."""
    _CALLS["n"] += 1
    return f"stepvault/{what}/{_CALLS['n']}"


def handshake(what: str, timeout: float) -> None:
    """Fail fast and clearly unless every rank reaches this call (a collective misuse check).

    A rank-0-only save of a sharded model (the classic ZeRO-3 mistake) would otherwise
    write a partial checkpoint or hang in the first collective.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    tag = c10d_tag(what)
    store.set(f"{tag}/{dist.get_rank()}", "1")
    keys = [f"{tag}/{r}" for r in range(dist.get_world_size())]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise StepvaultError(
            f"{what}: ranks {missing} did not call it within {timeout:.0f}s. Under a process "
            "group every rank must call stepvault.save/restore with its own shards (saving "
            "on rank 0 only would keep just rank 0's shards of a sharded model). For a "
            "replicated (DDP) model saved from one rank, pass collective=False"
        ) from None


# ------------------------------------------------------------------ the collective restore
# Rank 0 chooses; its candidates and the first candidate's manifest bytes reach every rank
# in one broadcast; every rank parses that manifest once and hands the parsed manifest to
# whatever reads it (the DCP reader, the pruning of RNG entries, the full-checkpoint path,
# the caller's RestoreInfo). Damage anywhere is agreed on by every rank before any rank
# places a byte, so every rank falls back together and none changes its state alone.


def _share(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the value itself without a process group)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _manifest_bytes(store: Store, run: str, step: int) -> bytes | str:
    """``run@step``'s manifest bytes, or why they cannot be read (rank 0 only)."""
    try:
        return store.read_manifest(run, step)
    except StepvaultError as exc:
        return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Offer:
    """Rank 0's restore candidates, as every rank has them: the steps in order, whether
    damage falls back, and the first step's manifest (bytes as read; why they could not
    be read; or already parsed, in one process)."""

    steps: list[int]
    fallback: bool
    first: bytes | str | Manifest | None = None


def share_offer(store: Store, run: str, choose: Callable[[], tuple[list[int], bool]]) -> Offer:
    """Collective: rank 0 runs ``choose()`` (``(steps, fallback)``) and reads the first
    step's manifest; every rank gets both in one broadcast. An error on rank 0 is raised
    on every rank (no rank is left waiting)."""
    payload: tuple[Any, ...] | None = None
    error: BaseException | None = None
    if current_rank() == 0:
        try:
            steps, fallback = choose()
            first = _manifest_bytes(store, run, steps[0]) if steps else None
            payload = ("ok", list(steps), bool(fallback), first)
        except Exception as exc:  # every rank must hear of it
            error, payload = exc, ("error", f"{type(exc).__name__}: {exc}")
    payload = _share(payload)
    if error is not None:
        raise error
    assert payload is not None
    if payload[0] == "error":
        raise StepvaultError(f"choosing the checkpoint of {run!r} failed on rank 0: {payload[1]}")
    return Offer(payload[1], payload[2], payload[3])


def _failures(exc: BaseException) -> list[object]:
    """The exceptions of each rank a DCP ``CheckpointException`` carries (its ``failures``
    map a rank to an ``(exception, traceback summary)`` pair); empty for any other."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]


def _is_damage(exc: BaseException) -> bool:
    if isinstance(exc, IntegrityError):
        return True
    # a rank's exception rebuilt from a pickle may have lost its class: its name counts
    damage = ("IntegrityError", "CorruptObjectError", "MissingObjectError")
    return any(
        isinstance(f, IntegrityError) or any(name in repr(f) for name in damage)
        for f in _failures(exc)
    )


def _mismatch(exc: BaseException) -> StateMismatchError | None:
    """The :class:`StateMismatchError` a (DCP-wrapped) failure carries, if it is one."""
    if isinstance(exc, StateMismatchError):
        return exc
    return next((f for f in _failures(exc) if isinstance(f, StateMismatchError)), None)


def try_candidates(
    store: Store,
    run: str,
    offer: Offer,
    attempt: Callable[[int, Manifest], None],
) -> tuple[int, Manifest, list[tuple[int, str]]]:
    """Collective: ``attempt(step, manifest)`` on every rank for each step of ``offer``
    until one succeeds everywhere; ``(step, manifest, skipped)``.

    Each candidate's manifest is parsed once per rank (the first from the offer; after a
    fallback rank 0 reads the next one and shares its bytes). A damaged candidate
    (unreadable manifest, or an :class:`IntegrityError` that ``attempt`` raised on any
    rank: the ranks agree before placing) is skipped when ``offer.fallback``; any other
    failure, a :class:`StateMismatchError` included, is raised. Raises
    :class:`CheckpointNotFoundError` when the offer is empty.
    """
    from ..format import parse_manifest

    if not offer.steps:
        raise CheckpointNotFoundError(f"run {run!r} has no committed checkpoint")
    skipped: list[tuple[int, str]] = []
    data = offer.first
    for i, candidate in enumerate(offer.steps):
        if i:  # a fallback: the next candidate's manifest, shared the same way
            data = _share(_manifest_bytes(store, run, candidate) if current_rank() == 0 else None)
        try:
            if isinstance(data, str) or data is None:
                raise ManifestError(f"{run}@{candidate}: {data or 'no manifest'}")
            manifest = (
                data if isinstance(data, Manifest) else parse_manifest(data, f"{run}@{candidate}")
            )
            attempt(candidate, manifest)
            return candidate, manifest, skipped
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            mismatch = _mismatch(exc)
            if mismatch is not None:
                raise mismatch from None
            if not offer.fallback or not _is_damage(exc):
                raise
            skipped.append((candidate, str(exc)))
    raise NoValidCheckpointError(
        f"no checkpoint of run {run!r} could be loaded on every rank: {skipped}", skipped
    )


def agree(store: Store, damage: BaseException | None, what: str) -> None:
    """Collective: raise on every rank when any rank found damage (its own error where it
    found it, an :class:`IntegrityError` naming the rank elsewhere); the damaged object is
    quarantined so that no later save deduplicates against it."""
    if isinstance(damage, CorruptObjectError) and damage.digest:
        store.quarantine_object(damage.digest)
    mine = None if damage is None else f"{type(damage).__name__}: {damage}"
    everyone: list[Any] = [mine]
    if world_size() > 1:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, mine)
    if damage is not None:
        raise damage
    bad = [(rank, why) for rank, why in enumerate(everyone) if why is not None]
    if bad:
        rank, why = bad[0]
        raise IntegrityError(f"{what}: rank {rank} found damage: {why}")


def agree_fits(problems: list[str], manifest: Manifest) -> None:
    """Collective: a :class:`StateMismatchError` on every rank when the checkpoint does
    not fit the live state of any rank (no byte read yet); it names that rank."""
    everyone: list[Any] = [problems]
    if world_size() > 1:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, problems)
    bad = [(rank, found) for rank, found in enumerate(everyone) if found]
    if bad:
        rank, found = bad[0]
        where = f"{manifest.run}@{manifest.step}" + (f" (rank {rank})" if world_size() > 1 else "")
        raise StateMismatchError([f"{where}: {problem}" for problem in found])
