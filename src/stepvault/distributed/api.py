"""Sharded save on a process group: every rank calls these with its own shards.

:func:`save_sharded` saves a DCP state dict; :func:`save_state` is ``stepvault.save`` on
every rank (modules, optimizers, RNGs and values); :class:`AsyncSaver` starts the same
save in the background for the manager. Before a byte is written every rank must have
called (:func:`~.agreement.handshake`) and every rank's values must be encodable
(:func:`refuse_unencodable`); :func:`collective_kind` is the one rule for the kind a save
is written as under a group. The restore side is :mod:`.restoring`; how the ranks agree
is :mod:`.agreement`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import UnsupportedTypeError
from ..store import Store
from .agreement import c10d_tag, group_store, handshake
from .host_copies import HostCopies, Unstaged
from .planners import SafeSavePlanner, encode_value
from .state import to_dcp
from .storage import StepvaultWriter

__all__ = [
    "LIGHT_UNDER_GROUP",
    "AsyncSaver",
    "collective_kind",
    "refuse_unencodable",
    "save_sharded",
    "save_state",
]


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
    metadata: Any = None,
    host: HostCopies | None = None,
) -> None:
    """Save a (possibly sharded: DTensor, FSDP2) state dict from every rank of the group.

    ``metadata`` is the user metadata in its safe encoding (``core.values.encode_metadata``);
    rank 0's value is the one committed. ``host``: this rank's host copies of the state
    (its memory copy), whose chunk digests the write shares (:mod:`.host_copies`).

    Every rank writes its own shards in parallel; replicated tensors are written once; the
    coordinator commits only after every rank reported success. If any rank fails, nothing
    is committed and every rank raises (DCP's ``CheckpointException``).
    """
    store = group_store(root, create=True)
    writer = StepvaultWriter(
        store,
        run,
        step,
        epoch=epoch,
        metrics=dict(metrics or {}),
        codec=codec,
        workers=workers,
        lineage=lineage,
        metadata=metadata,
        host=host,
    )
    dcp.save(dict(state_dict), storage_writer=writer, planner=SafeSavePlanner())


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
    metadata: Any = None,
    host: HostCopies | None = None,
) -> None:
    """``stepvault.save`` on every rank: modules, optimizers, RNGs and values via DCP.

    ``lineage`` is the digest of a lineage record already stored for ``run``, ``metadata``
    the encoded user metadata (rank 0's values are the ones committed). ``host``: this
    rank's host copies of ``state`` (its memory copy), written in place of the live
    tensors, with shared chunk digests (:mod:`.host_copies`).
    """
    handshake(f"save {run}@{step}", timeout)
    dcp_state = _with_kinds(state, host)
    refuse_unencodable(f"save {run}@{step}", dcp_state, timeout)
    if host is not None:
        dcp_state = host.substitute(dcp_state) or dcp_state
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
        metadata=metadata,
        host=host,
    )


def _with_kinds(state: Mapping[str, Any], host: HostCopies | None = None) -> dict[str, Any]:
    """The DCP state dict of a stepvault state, with the kind of each top-level entry
    (the one the rank's memory copy was taken from, when it made one of ``state``)."""
    if host is not None and host.dcp_state is not None:
        return dict(host.dcp_state)
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
    store = dist.distributed_c10d._get_default_store()
    tag = c10d_tag(f"{what}/values")
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
        """Release the staging buffers and destroy the group this saver created (a gloo
        group left to the interpreter's exit can abort the process there)."""
        self._stager.release()
        pg, self._pg = self._pg, None
        if pg is not None and dist.is_initialized():
            with contextlib.suppress(ValueError, RuntimeError):  # already destroyed
                dist.destroy_process_group(pg)

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
        metadata: Any = None,
        host: HostCopies | None = None,
    ) -> Any:
        """Stage ``state`` and start its save; returns a future that the commit completes.

        Every rank must call this; if any rank fails, the future raises on every rank and
        nothing is committed. ``host``: this rank's host copies of ``state`` (its memory
        copy, made on the training thread): DCP writes them as they are (no second copy
        into the kept staging buffers) with shared chunk digests (:mod:`.host_copies`).
        """
        handshake(f"save {run}@{step}", timeout)
        dcp_state = _with_kinds(state, host)
        refuse_unencodable(f"save {run}@{step}", dcp_state, timeout)
        stager: Any = self._stager
        copied = None if host is None else host.substitute(dcp_state)
        if copied is not None:  # already a host copy the training thread does not touch
            dcp_state, stager = copied, Unstaged()
        writer = StepvaultWriter(
            store,
            run,
            step,
            epoch=epoch,
            metrics=dict(metrics or {}),
            codec=codec,
            workers=workers,
            lineage=lineage,
            metadata=metadata,
            host=host,
        )
        return dcp.async_save(
            dcp_state,
            storage_writer=writer,
            planner=SafeSavePlanner(),
            process_group=self._pg,
            async_stager=stager,
        )
