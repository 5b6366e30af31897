"""A rank's host copies of its live tensors, written by its memory copy and its DCP write.

With ``MemOptions(replicate=True)`` a collective save that also goes to disk has two
destinations on every rank: the rank's node memory (a host copy of its own state, made on
the training thread) and its shards of the DCP write. Both hold the same bytes; hashing
them once per destination cost one more pass over the rank's state (issue 27). Here the
DCP write reads the memory copy's host buffers instead of the live tensors (or DCP's own
staging copy), and both writes share one :class:`~stepvault.engine.writer.ChunkDigests`
keyed by those buffers, so a chunk is hashed once whichever destination reaches it first.

Invariant 2 holds because a digest is reused only for a chunk read from the very buffers
it was computed from (the digests refuse any other array: it is hashed as usual), and the
buffers do not change until both writes are done (a collective save waits for the
previous one before the next stage overwrites them). A live tensor is replaced by its host
copy only when the copy was taken from exactly that view (address, dtype, shape, strides):
the same values in the same order. When some tensor of the DCP state has no copy, nothing
is replaced and the save runs as before (DCP's own staging for an asynchronous save).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ..engine import HostArray, to_host
from ..engine.writer import ChunkDigests

__all__ = ["HostCopies", "Unstaged"]


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device.type, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


class HostCopies:
    """The host copies of one save on one rank and their shared chunk digests."""

    def __init__(self) -> None:
        self._by_source: dict[tuple[Any, ...], torch.Tensor] = {}
        # The sources themselves, held until the DCP state is substituted: a source freed
        # meanwhile (a temporary, say an RNG state read) could leave its address to
        # another tensor of the same shape, which would then match falsely.
        self._sources: list[torch.Tensor] = []
        self._by_buffer: dict[tuple[Any, ...], HostArray] = {}
        self.arrays: dict[str, HostArray] = {}
        self._digests: ChunkDigests | None = None
        #: the DCP state dict the memory copy was taken from (sharded state: the rank's
        #: local shards are its views), for the DCP write to use instead of building
        #: another (which would read an RNG state, say, a second time); None: build it
        self.dcp_state: dict[str, Any] | None = None
        #: tensors of the last substituted state that had no host copy (copied there)
        self.unmatched = 0

    def add(self, name: str, source: torch.Tensor, buffer: torch.Tensor) -> HostArray:
        """Record ``buffer`` (a contiguous CPU tensor) as the copy of ``source`` taken now;
        returns its host array (stored under ``name`` by the memory copy)."""
        host = to_host(buffer)
        self.arrays[name] = host
        self._by_source.setdefault(_view_key(source.detach()), buffer)
        self._sources.append(source)
        self._by_buffer[_view_key(buffer)] = host
        return host

    @property
    def digests(self) -> ChunkDigests:
        """The chunk digests of these buffers, shared by every write of this save."""
        if self._digests is None:
            self._digests = ChunkDigests(self.arrays, shared=True)
        return self._digests

    def host_array(self, tensor: torch.Tensor) -> HostArray:
        """The registered host array when ``tensor`` is one of these buffers, whole (its
        chunks then share digests); else a host view of ``tensor``, hashed as usual."""
        found = self._by_buffer.get(_view_key(tensor.detach()))
        return found if found is not None else to_host(tensor.detach())

    def substitute(self, dcp_state: Mapping[str, Any]) -> dict[str, Any] | None:
        """``dcp_state`` with every tensor replaced by its host copy and every other value
        copied (the training thread may change the live ones while it is written), or
        None when some tensor is a subclass other than DTensor: then the caller writes
        ``dcp_state`` as before. A tensor the memory copy did not take is copied here (a
        memory copy, as DCP's staging would make) and hashed by the DCP write alone."""
        from torch.distributed.tensor import DTensor

        missing: list[str] = []

        def sub(value: Any, path: str) -> Any:
            if isinstance(value, DTensor):
                # Sharded state: the memory copy took this rank's local shard
                # (local_shards.localize). The same global tensor with the host copy as
                # its local shard, as DCP's own staging makes it (a CPU local tensor under
                # the original spec: mesh, placements, global shape).
                local = value.to_local().detach()
                found = self._by_source.get(_view_key(local))
                if found is None:
                    found = local.to("cpu", copy=True)
                    self.unmatched += 1
                return DTensor(found, value._spec, requires_grad=False)
            if isinstance(value, torch.Tensor):
                if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                    missing.append(path)  # another tensor subclass: not replaced
                    return value
                found = self._by_source.get(_view_key(value.detach()))
                if found is None:
                    # Not taken by the memory copy (e.g. an RNG state read again): a copy
                    # of its own, written and hashed as usual.
                    found = value.detach().to("cpu", copy=True)
                    self.unmatched += 1
                return found
            if isinstance(value, dict):
                out = copy.copy(value)  # the same mapping type (OrderedDict stays one)
                for k in value:
                    out[k] = sub(value[k], f"{path}/{k}")
                return out
            if type(value) in (list, tuple):
                return type(value)(sub(v, f"{path}/{i}") for i, v in enumerate(value))
            return copy.deepcopy(value)

        self.unmatched = 0
        out = sub(dict(dcp_state), "")
        return None if missing else out

    def forget_sources(self) -> None:
        """Drop the live tensors (the training thread's part of the save is over): nothing
        is substituted any more."""
        self._sources, self._by_source, self.dcp_state = [], {}, None


class Unstaged:
    """An ``AsyncStager`` for a state that is already a host copy: DCP's asynchronous save
    writes it as given, with no second copy on the training thread."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
