"""Sharded save and load on a process group: every rank calls them with its own shards."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._rank import current_rank, world_size
from ..errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    IntegrityError,
    ManifestError,
    NoValidCheckpointError,
    StateMismatchError,
    StepvaultError,
    UnsupportedTypeError,
)
from ..format import Manifest
from ..format.settings import DEFAULT_STORE_SETTINGS
from ..store import Store
from .planners import SafeLoadPlanner, SafeSavePlanner, encode_value
from .state import apply_dcp, to_dcp
from .storage import StepvaultReader, StepvaultWriter


def _store(root: str | os.PathLike[str] | Store, create: bool) -> Store:
    if isinstance(root, Store):
        return root
    if create and current_rank() == 0:
        Store.open(root, create=True, defaults=DEFAULT_STORE_SETTINGS)
    if create and dist.is_initialized():
        dist.barrier()  # the store exists before any other rank opens it
    return Store.open(root)


def save_sharded(
    root: str | os.PathLike[str] | Store,
    state_dict: Mapping[str, Any],
    *,
    run: str,
    step: int,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
    codec: str | None = None,
    workers: int | None = None,
    lineage: str | None = None,
) -> None:
    """Save a (possibly sharded: DTensor, FSDP2) state dict from every rank of the group.

    Every rank writes its own shards in parallel; replicated tensors are written once; the
    coordinator commits only after every rank reported success. If any rank fails, nothing
    is committed and every rank raises (DCP's ``CheckpointException``).
    """
    store = _store(root, create=True)
    writer = StepvaultWriter(
        store,
        run,
        step,
        epoch=epoch,
        metrics=dict(metrics or {}),
        codec=codec,
        workers=workers,
        lineage=lineage,
    )
    dcp.save(dict(state_dict), storage_writer=writer, planner=SafeSavePlanner())


def load_sharded(
    root: str | os.PathLike[str] | Store,
    state_dict: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    workers: int | None = None,
) -> int:
    """Load into ``state_dict`` (in place, resharding as needed); returns the step loaded.

    With ``"latest"`` all ranks agree on the newest checkpoint that every rank could read
    and verify: if any rank finds damage, all ranks fall back together to the next one.
    """
    store = _store(root, create=False)

    def attempt(candidate: int, manifest: Manifest) -> None:
        if isinstance(state_dict, _Targets):
            state_dict.prune_for(manifest)
        _dcp_load(store, state_dict, run, candidate, manifest, workers)

    offer = share_offer(store, run, lambda: _steps(store, run, step))
    chosen, _, _ = try_candidates(store, run, offer, attempt)
    return chosen


def _steps(store: Store, run: str, step: int | Literal["latest"]) -> tuple[list[int], bool]:
    """``"latest"``: every step, newest first, falling back; a step: that one alone."""
    if step == "latest":
        return list(reversed(store.list_steps(run))), True
    return [int(step)], False


def _is_damage(exc: BaseException) -> bool:
    if isinstance(exc, IntegrityError):
        return True
    failures = getattr(exc, "failures", None)  # CheckpointException: rank -> exception
    if isinstance(failures, dict):
        return any(
            isinstance(f, IntegrityError)
            or "IntegrityError" in repr(f)
            or "CorruptObjectError" in repr(f)
            or "MissingObjectError" in repr(f)
            for f in failures.values()
        )
    return False


def _mismatch(exc: BaseException) -> StateMismatchError | None:
    """The :class:`StateMismatchError` a (DCP-wrapped) failure carries, if it is one."""
    if isinstance(exc, StateMismatchError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            if isinstance(failure, StateMismatchError):
                return failure
    return None


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


def _dcp_load(
    store: Store,
    targets: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
) -> None:
    """One DCP load of ``run@step`` (its manifest parsed) into ``targets``: every rank
    verifies what it needs and the ranks agree before any byte is placed."""
    reader = StepvaultReader(
        store,
        run,
        step,
        workers=workers,
        manifest=manifest,
        verified=lambda damage: agree(store, damage, f"{run}@{step}"),
    )
    dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner())


__all__ = [
    "collective_kind",
    "load_sharded",
    "restore_state",
    "save_sharded",
    "save_state",
    "torch",
]


_CALLS = {"n": 0}


def handshake(what: str, timeout: float) -> None:
    """Fail fast and clearly unless every rank reaches this call (a collective misuse check).

    A rank-0-only save of a sharded model (the classic ZeRO-3 mistake) would otherwise
    write a partial checkpoint or hang in the first collective.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from datetime import timedelta

    _CALLS["n"] += 1
    store = dist.distributed_c10d._get_default_store()
    tag = f"stepvault/{what}/{_CALLS['n']}"
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


#: The one-time warning of :func:`collective_kind` (once per process, not per save).
LIGHT_UNDER_GROUP = (
    "light saves under a process group are written as full checkpoints (SaveInfo.kind "
    "and the save event say 'full'; this warning is shown once per process): a light "
    "checkpoint is built by one process, as deltas against a full checkpoint it reads "
    "whole. Light checkpoints need one process; under a group, ask for full saves"
)
_light_warned = False


def collective_kind(kind: str) -> str:
    """The kind a save of ``kind`` is written as under a process group: a light save is
    written full (a one-time RuntimeWarning says why), every other kind as asked.

    The one rule of every collective entry point (``stepvault.save`` and the manager):
    refusing would stop a training job whose save policy emits light saves.
    """
    global _light_warned
    if kind != "light":
        return kind
    if not _light_warned:
        _light_warned = True
        warnings.warn(LIGHT_UNDER_GROUP, RuntimeWarning, stacklevel=3)
    return "full"


def save_state(
    root: str | os.PathLike[str] | Store,
    state: Mapping[str, Any],
    *,
    run: str,
    step: int,
    epoch: int | None = None,
    metrics: Mapping[str, float] | None = None,
    codec: str | None = None,
    workers: int | None = None,
    timeout: float = 60.0,
    lineage: str | None = None,
) -> None:
    """``stepvault.save`` on every rank: modules, optimizers, RNGs and values via DCP.

    ``lineage`` is the digest of a lineage record already stored for ``run`` (rank 0's
    value is the one committed).
    """
    handshake(f"save {run}@{step}", timeout)
    dcp_state = _with_kinds(state)
    refuse_unencodable(f"save {run}@{step}", dcp_state, timeout)
    save_sharded(
        root,
        dcp_state,
        run=run,
        step=step,
        epoch=epoch,
        metrics=metrics,
        codec=codec,
        workers=workers,
        lineage=lineage,
    )


def _with_kinds(state: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of a stepvault state, with the kind of each top-level entry."""
    dcp_state, kinds = to_dcp(state, for_save=True)
    dcp_state["__stepvault_kinds__"] = kinds
    return dcp_state


def _unencodable(dcp_state: dict[str, Any]) -> str | None:
    """Why a non-tensor value of ``dcp_state`` cannot be stored, or None: the encoding
    ``SafeSavePlanner`` applies to each value DCP writes as bytes (the same leaves: DCP's
    flattening), run before the save starts."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dcp_state)
    for fqn, leaf in flat.items():
        if hasattr(leaf, "__create_write_items__") or isinstance(
            leaf, (torch.Tensor, ShardedTensor)
        ):
            continue  # a tensor item (DTensor, sharded or plain), not encoded
        try:
            encode_value(leaf, fqn)
        except UnsupportedTypeError as exc:
            return str(exc)
    return None


def refuse_unencodable(what: str, dcp_state: dict[str, Any], timeout: float) -> None:
    """Raise :class:`UnsupportedTypeError` on every rank, before a byte is written, when a
    value of any rank's state cannot be encoded (invariant 3, as for one process).

    Without this the value was refused while DCP wrote it, by the one rank that writes it,
    after the other ranks had written their shards: DCP's ``CheckpointException`` (a
    ``BaseException``, which ``except Exception`` and ``on_save_error="warn"`` let
    through), and from the manager only at the next ``wait()``. The ranks agree through
    the c10d store (as :func:`handshake`), so a value only one rank holds is refused on all.
    """
    problem = _unencodable(dcp_state)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem is not None:
            raise UnsupportedTypeError(f"{problem}. Nothing was written")
        return
    from datetime import timedelta

    _CALLS["n"] += 1
    store = dist.distributed_c10d._get_default_store()
    tag = f"stepvault/{what}/values/{_CALLS['n']}"
    store.set(f"{tag}/{dist.get_rank()}", problem or "")
    keys = [f"{tag}/{r}" for r in range(dist.get_world_size())]
    store.wait(keys, timedelta(seconds=timeout))
    for rank, value in enumerate(store.multi_get(keys)):
        if value:
            raise UnsupportedTypeError(
                f"rank {rank}: {bytes(value).decode()}. Nothing was written on any rank"
            )


class AsyncSaver:
    """Background multi-rank saves through ``torch.distributed.checkpoint.async_save``.

    The training thread only copies each rank's shards into CPU buffers that are allocated
    once and reused (DCP's ``DefaultStager``); planning, writing and the
    coordinator's commit run on a background thread. The background collectives use a
    dedicated gloo process group, created once here on every rank, so they never interleave
    with the training job's own collectives on the default group.
    """

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import StagingOptions

        from .stager import KeptStager

        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # DefaultStager keeps the CPU copy of every storage it staged (keyed weakly by the
        # source storage), so parameters and optimizer moments are copied into the same
        # buffers save after save. Pinned only where CUDA exists.
        cuda = torch.cuda.is_available()
        self._stager = KeptStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )

    def close(self) -> None:
        """Release the staging buffers."""
        self._stager.release()

    def save(
        self,
        store: Store,
        state: Mapping[str, Any],
        *,
        run: str,
        step: int,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        codec: str | None = None,
        workers: int | None = None,
        lineage: str | None = None,
        timeout: float = 60.0,
    ) -> Any:
        """Stage ``state`` and start its save; returns a future that the commit completes.

        Every rank must call this; if any rank fails, the future raises on every rank and
        nothing is committed.
        """
        handshake(f"save {run}@{step}", timeout)
        dcp_state = _with_kinds(state)
        refuse_unencodable(f"save {run}@{step}", dcp_state, timeout)
        writer = StepvaultWriter(
            store,
            run,
            step,
            epoch=epoch,
            metrics=dict(metrics or {}),
            codec=codec,
            workers=workers,
            lineage=lineage,
        )
        return dcp.async_save(
            dcp_state,
            storage_writer=writer,
            planner=SafeSavePlanner(),
            process_group=self._pg,
            async_stager=self._stager,
        )


def restore_state(
    root: str | os.PathLike[str] | Store,
    state: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    workers: int | None = None,
    timeout: float = 60.0,
    strict: bool = True,
) -> int:
    """``stepvault.restore`` on every rank (resharding to this world size); returns the step.

    ``"latest"`` is the newest checkpoint that every rank verifies (all fall back
    together). The core's restore planner chooses its own candidates and calls
    :func:`try_candidates` with :func:`restore_checkpoint` instead.
    """
    handshake(f"restore {run}", timeout)
    store = _store(root, create=False)

    def attempt(candidate: int, manifest: Manifest) -> None:
        restore_checkpoint(store, state, run, candidate, manifest, workers=workers, strict=strict)

    # rank 0's view decides, so every rank tries the same list
    offer = share_offer(store, run, lambda: _steps(store, run, step))
    chosen, _, _ = try_candidates(store, run, offer, attempt)
    return chosen


def restore_checkpoint(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    *,
    workers: int | None = None,
    strict: bool = True,
) -> None:
    """Collective: restore ``run@step`` (``manifest`` already parsed) into the live
    objects of ``state`` on every rank, resharding as needed.

    Invariant 4 on every rank: the checkpoint is checked against the live state (a
    :class:`StateMismatchError` on every rank when it does not fit), every object this
    rank needs is verified and the ranks agree that all did, and only then is live state
    changed. A fresh optimizer that DCP gave a state to build its load targets is emptied
    again when the restore fails.
    """
    fresh = [o for o in state.values() if isinstance(o, torch.optim.Optimizer) and not o.state]
    try:
        if manifest.sharded:
            _restore_sharded(store, state, run, step, manifest, workers, strict)
        else:
            _restore_full(store, state, run, step, manifest, workers, strict)
    except BaseException:
        for opt in fresh:
            opt.state.clear()
        raise


def _restore_sharded(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
    strict: bool,
) -> None:
    dcp_state, kinds = to_dcp(state)
    targets = _Targets(store, run, dcp_state, kinds, f"rank{current_rank()}")
    targets.prune_for(manifest)
    _agree_fits(_sharded_problems(manifest, targets), manifest)
    _dcp_load(store, targets, run, step, manifest, workers)
    apply_dcp(state, targets, kinds)


def _restore_full(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
    strict: bool,
) -> None:
    """A checkpoint of one process on every rank: read whole (it fitted in one process
    when it was saved), checked, verified and agreed on; each rank keeps its shards."""
    from ..engine import CheckpointReader
    from ..engine.load import _pick
    from ..format import decode_value
    from .state import full_checkpoint_problems, restore_full_checkpoint

    reader = CheckpointReader(store, manifest, workers=workers)
    meta = decode_value(manifest.state, lambda kind, name: reader.meta(name))
    problems = full_checkpoint_problems(state, meta, manifest.state_kinds, strict=strict)
    _agree_fits(problems, manifest)
    damage: BaseException | None = None
    tree: dict[str, Any] = {}
    try:
        arrays = reader.read_all()
        tree = decode_value(manifest.state, lambda kind, name: _pick(arrays, kind, name))
    except StepvaultError as exc:
        damage = exc
    agree(store, damage, f"{run}@{step}")
    restore_full_checkpoint(store, state, run, step, workers=workers, loaded=(manifest, tree))


def _agree_fits(problems: list[str], manifest: Manifest) -> None:
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


def _sharded_problems(manifest: Manifest, targets: Mapping[str, Any]) -> list[str]:
    """What stops DCP from loading ``manifest`` into ``targets``: tensors the checkpoint
    lacks or holds with another (global) shape."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    entries = (manifest.sharded or {}).get("entries", {})
    flat, _ = flatten_state_dict(dict(targets))
    problems = []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        size = tuple(value.size())
        entry = entries.get(fqn)
        if entry is None:
            problems.append(f"{fqn}: not in checkpoint")
        elif entry.get("type") == "tensor" and tuple(entry["size"]) != size:
            problems.append(f"{fqn}: checkpoint has shape {tuple(entry['size'])}, live {size}")
    return problems


class _Targets(dict):
    """The DCP target dict; drops RNG entries of ranks the checkpoint does not have."""

    def __init__(self, store, run, dcp_state, kinds, rank_key):
        super().__init__(dcp_state)
        self._kinds = kinds
        self._rank_key = rank_key
        self._source = dcp_state

    def prune_for(self, manifest) -> None:
        names = set((manifest.sharded or {}).get("entries", {}))
        for key, kind in self._kinds.items():
            if kind == "rng" and not any(n.startswith(f"{key}.{self._rank_key}.") for n in names):
                self.pop(key, None)
