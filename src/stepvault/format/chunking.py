"""Chunk planning: split big tensors into fixed-size pieces, bundle small ones.

Fixed offsets (not content-defined boundaries) are right for tensors: they are updated in
place, so an unchanged region stays at the same offset and hashes the same. Chunk sizes are
rounded down to whole elements so the float codec always sees complete values. Small
tensors are packed, per dtype and in state order, into bundles so that a model with
thousands of small tensors does not become thousands of tiny objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CHUNK_SIZE = 32 << 20
DEFAULT_SMALL_TENSOR = 1 << 20
DEFAULT_BUNDLE_SIZE = 8 << 20
#: Members of a bundle start at multiples of this, so raw bundles map as aligned tensors.
BUNDLE_ALIGN = 64


@dataclass
class ArraySpec:
    name: str
    dtype: str
    itemsize: int
    nbytes: int


@dataclass
class ChunkPlan:
    """One future object. ``members``: (array name, offset in array, offset in chunk, length)."""

    dtype: str | None
    size: int
    members: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def is_bundle(self) -> bool:
        return len(self.members) != 1 or self.members[0][2] != 0


def plan_chunks(
    arrays: list[ArraySpec],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    small_tensor: int = DEFAULT_SMALL_TENSOR,
    bundle_size: int = DEFAULT_BUNDLE_SIZE,
) -> list[ChunkPlan]:
    """Plan the objects for ``arrays`` (in order); every byte of every array is covered once."""
    if chunk_size < 1024:
        raise ValueError("chunk_size must be at least 1 KiB")
    plans: list[ChunkPlan] = []
    open_bundles: dict[str, ChunkPlan] = {}
    for a in arrays:
        if a.nbytes == 0:
            continue
        if a.nbytes < small_tensor and a.nbytes <= bundle_size:
            bundle = open_bundles.get(a.dtype)
            start = 0 if bundle is None else -(-bundle.size // BUNDLE_ALIGN) * BUNDLE_ALIGN
            if bundle is None or start + a.nbytes > bundle_size:
                bundle = ChunkPlan(a.dtype, 0)
                open_bundles[a.dtype] = bundle
                plans.append(bundle)
                start = 0
            bundle.members.append((a.name, 0, start, a.nbytes))
            bundle.size = start + a.nbytes
            continue
        step = max(a.itemsize, chunk_size - chunk_size % a.itemsize)
        for off in range(0, a.nbytes, step):
            length = min(step, a.nbytes - off)
            plans.append(ChunkPlan(a.dtype, length, [(a.name, off, 0, length)]))
    return plans
