"""Sharded save and load on a process group: every rank calls them with its own shards."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    NoValidCheckpointError,
    StepvaultError,
)
from ..format.settings import DEFAULT_STORE_SETTINGS
from ..store import Store
from .planners import SafeLoadPlanner, SafeSavePlanner
from .state import apply_dcp, to_dcp
from .storage import StepvaultReader, StepvaultWriter


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _store(root: str | os.PathLike[str] | Store, create: bool) -> Store:
    if isinstance(root, Store):
        return root
    if create and _rank() == 0:
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
    steps = store.list_steps(run)
    candidates = list(reversed(steps)) if step == "latest" else [int(step)]
    if dist.is_initialized():  # rank 0's view decides, so every rank tries the same list
        box = [candidates]
        dist.broadcast_object_list(box, src=0)
        candidates = box[0]
    if not candidates:
        raise CheckpointNotFoundError(f"run {run!r} has no committed checkpoint")
    skipped = []
    for candidate in candidates:
        try:
            if hasattr(state_dict, "prune_for"):
                from ..format import parse_manifest

                state_dict.prune_for(
                    parse_manifest(store.read_manifest(run, candidate), f"{run}@{candidate}")
                )
            dcp.load(
                state_dict,
                storage_reader=StepvaultReader(store, run, candidate, workers=workers),
                planner=SafeLoadPlanner(),
            )
            return candidate
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if step != "latest" or not _is_damage(exc):
                raise
            skipped.append((candidate, str(exc)))
    raise NoValidCheckpointError(
        f"no checkpoint of run {run!r} could be loaded on every rank: {skipped}", skipped
    )


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


__all__ = ["load_sharded", "restore_state", "save_sharded", "save_state", "torch"]


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
    save_sharded(
        root,
        _with_kinds(state),
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
            _with_kinds(state),
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
) -> int:
    """``stepvault.restore`` on every rank (resharding to this world size); returns the step."""
    handshake(f"restore {run}", timeout)
    store = _store(root, create=False)
    newest: int | Literal["latest"] | None = step
    if step == "latest":
        steps = store.list_steps(run)
        newest = steps[-1] if steps else None
    if dist.is_initialized():
        box = [newest]
        dist.broadcast_object_list(box, src=0)
        newest = box[0]
    if isinstance(newest, int) and not _sharded(store, run, newest):
        # Written by a single-process save: every rank reads the full checkpoint and keeps
        # its own shards (it fitted in one process when it was saved).
        from .state import restore_full_checkpoint

        restore_full_checkpoint(store, state, run, newest, workers=workers)
        return newest
    dcp_state, kinds = to_dcp(state)
    rank_key = f"rank{_rank()}"
    targets = _Targets(store, run, dcp_state, kinds, rank_key)
    chosen = load_sharded(store, targets, run=run, step=step, workers=workers)
    apply_dcp(state, targets, kinds)
    return chosen


def _sharded(store: Store, run: str, step: int) -> bool:
    from ..format import parse_manifest

    try:
        return bool(parse_manifest(store.read_manifest(run, step), f"{run}@{step}").sharded)
    except StepvaultError:
        return True  # let the DCP path report (and fall back past) the damage


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
