"""Local or collective: the one place where the manager differs between a single process
(or a rank-local manager under a process group) and every rank saving together.

The strategy is chosen once, when the manager is made; the rest of the manager asks it
instead of branching on the process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.scope import is_collective
from ..distributed.state import distributed_active
from ..errors import StepvaultError
from ..policy import SaveDecision, merge_decisions
from ..store import Store
from ..store.lease import Lease, LeaseHeldError, acquire_lease


class LocalScope:
    """One process decides, writes, commits and logs. ``rank_local``: a manager on one
    rank of a process group (trainers that save a replicated model from rank 0)."""

    collective = False
    rank = 0
    coordinator = True

    def __init__(self, rank_local: bool = False) -> None:
        self.rank_local = rank_local

    def acquire_lease(self, store: Store, run: str, stale_after: float) -> Lease | None:
        """The run's lease, installed as the fence of its commits in ``store``."""
        try:
            return fenced(acquire_lease(store, run, stale_after=stale_after))
        except LeaseHeldError as exc:
            dist = torch.distributed
            if not (self.rank_local and dist.is_available() and dist.is_initialized()):
                raise
            if dist.get_world_size() < 2:
                raise
            # Likely another rank of this very job: a rank-local manager on every rank.
            raise LeaseHeldError(
                f"{exc}. Under a process group of {dist.get_world_size()} ranks a rank-local "
                "manager (collective=False) is made on one rank only (rank 0, which saves "
                "the replicated model); or make it on every rank with collective=True"
            ) from None

    def agree(self, decision: SaveDecision | None) -> SaveDecision | None:
        return decision

    def share(self, value: Any) -> Any:
        return value

    def check_state(self, state: Mapping[str, Any]) -> None:
        if self.rank_local:
            is_collective(state, False)  # refuses sharded DTensor state with a clear error
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            from ..distributed.state import has_dtensor

            if has_dtensor(state):  # a group of one rank: FSDP2 debugged on one process
                raise StepvaultError(
                    "the state holds DTensors (FSDP2 / tensor parallel) under a process "
                    "group of one rank, and this manager saves like a single process, "
                    "which cannot hold them: make it CheckpointManager(..., "
                    "collective=True) to save through the collective path on one rank, "
                    "or train without fully_shard on one process"
                )

    def check_restore(self, run: str, step: int) -> None:
        """A checkpoint several ranks wrote (``run@step``, a sharded job's) is restored
        here too. Rank-local under a process group (a DDP trainer's manager), this process
        reads it alone, as one process reshards: the full tensors, this rank's RNG where
        the checkpoint has this rank (``core.planner.restore_rank_local``). Nothing is
        refused here."""

    def barrier(self) -> None:
        pass


class CollectiveScope:
    """Every rank has a manager and saves its shards; rank 0 holds the lease, logs events
    and applies retention; decisions and restore candidates are rank 0's (or merged)."""

    collective = True
    rank_local = False

    def __init__(self) -> None:
        self.rank = torch.distributed.get_rank()
        self.coordinator = self.rank == 0

    def acquire_lease(self, store: Store, run: str, stale_after: float) -> Lease | None:
        lease, error = None, None
        if self.coordinator:
            try:  # rank 0 commits (DCP's finish), so its store carries the fence
                lease = fenced(acquire_lease(store, run, stale_after=stale_after))
            except StepvaultError as exc:
                error = str(exc)
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None:  # every rank fails together, none hangs later
            raise LeaseHeldError(box[0])
        return lease

    def agree(self, decision: SaveDecision | None) -> SaveDecision | None:
        """Every rank takes the same decision (clocks and signals differ between ranks)."""
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, decision)
        return merge_decisions([d for d in everyone if d is not None])

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (e.g. the restore candidates)."""
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def check_state(self, state: Mapping[str, Any]) -> None:
        pass

    def check_restore(self, run: str, step: int) -> None:
        pass

    def barrier(self) -> None:
        torch.distributed.barrier()


Scope = LocalScope | CollectiveScope


def fenced(lease: Lease) -> Lease:
    """Make every manifest commit or delete of the lease's run through its store check the
    lease first (``Store.fences``; removed by ``lease.release()``): a writer that lost the
    run to another one commits nothing more (store/lease.py)."""
    lease.store.fences[lease.run] = lease
    return lease


def choose_scope(collective: bool | None) -> Scope:
    """``collective=None``: collective under an initialised process group of more than one
    rank (a group of one saves like a single process); ``False``: rank-local; ``True``:
    collective under any initialised group, one rank included (FSDP2 state on one
    process)."""
    if collective and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            "collective=True needs an initialised torch.distributed process group (call "
            "torch.distributed.init_process_group first, e.g. under torchrun)"
        )
    if distributed_active() if collective is None else collective:
        return CollectiveScope()
    return LocalScope(rank_local=collective is False)
