"""Whether a save or restore is collective (every rank, through DCP) or local."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import StepvaultError


def is_collective(state: Mapping[str, Any], collective: bool | None) -> bool:
    """Whether a save/restore of ``state`` must run on every rank through DCP.

    ``collective=False`` (a rank-local call under a process group) refuses sharded DTensor
    state: one rank's save would keep only that rank's shards.
    """
    from ..distributed.state import distributed_active, has_dtensor

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
