"""Sharded (DTensor) state as this rank's local shards, for rank-local copies.

The node memory tier keeps each rank's *own* state (the same world size resumes from it).
For FSDP2 / tensor-parallel state that is the rank's local shards: the DCP state dict of
the live objects (``to_dcp``: FQN-keyed, the optimizer's moments keyed by parameter
name) with every DTensor replaced by its local tensor, which shares the DTensor's storage.
Reading a local shard is local: no collective runs on the writer thread. A restore loads
the stored shards into those same local tensors in place and hands the DCP state dict back
to the live objects with ``set_state_dict`` (``apply_dcp``), as a DCP load does.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .state import apply_dcp, to_dcp

#: the top-level keys of a localized state (the stored checkpoint has the same two)
SHARDS, KINDS = "dcp_local", "dcp_kinds"


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach()
    if isinstance(value, Mapping):
        return {k: _local(v) for k, v in value.items()}
    return value


def localize(
    state: Mapping[str, Any], *, for_save: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(local, dcp_state)``: the state to store or restore into (``{SHARDS: ..., KINDS:
    ...}``, plain tensors and values only) and the DCP state dict it views (``for_save``:
    see :func:`~stepvault.distributed.state.to_dcp`)."""
    dcp_state, kinds = to_dcp(state, for_save=for_save)
    return {SHARDS: _local(dcp_state), KINDS: dict(kinds)}, dcp_state


def _put_back(dcp_value: Any, loaded: Any) -> Any:
    """``loaded`` (what the restore left in the localized state) merged into the DCP state:
    tensors copied into the live local shards (unless loaded there in place), the rest
    taken as loaded."""
    if isinstance(dcp_value, DTensor):
        local = dcp_value.to_local()
        if isinstance(loaded, torch.Tensor) and loaded is not local:
            with torch.no_grad():
                local.copy_(loaded)
        return dcp_value
    if isinstance(dcp_value, MutableMapping) and isinstance(loaded, Mapping):
        for k in list(dcp_value):
            if k in loaded:
                dcp_value[k] = _put_back(dcp_value[k], loaded[k])
        return dcp_value
    return loaded


def apply_local(
    state: MutableMapping[str, Any], local: Mapping[str, Any], dcp_state: dict[str, Any]
) -> None:
    """Hand a restored localized state to the live objects of ``state``."""
    merged = _put_back(dcp_state, local[SHARDS])
    apply_dcp(state, merged, dict(local[KINDS]))
