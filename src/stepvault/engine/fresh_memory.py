"""Fresh host memory for the tensors a restore builds (optimizer moments, plain tensors).

A fresh optimizer has no state to copy into: a restore must allocate its moments. Taking
them one ``torch.empty`` at a time costs a page fault per 4 KiB page when the copy first
writes them; on the 2-core VM of BENCHMARKS.md, 64 tensors of 16 MiB took 0.33 s to
allocate and fill against 0.12 s for the same bytes in one anonymous mapping with
transparent huge pages (``MADV_HUGEPAGE``: one fault per 2 MiB). So the tensors are cut
from large mappings, each at a 64-byte boundary. Pages never written are never backed, so
the unused tail of the last mapping costs address space only; a mapping is returned to the
system when the last tensor cut from it is freed.
"""

from __future__ import annotations

import mmap

import numpy as np

#: Size of one mapping; a larger request gets a mapping of its own size.
BLOCK = 256 << 20
#: Each tensor starts at a multiple of this (cache lines; every dtype's alignment).
ALIGN = 64
#: Mappings are rounded up to whole huge pages.
_HUGE = 2 << 20


def _mapping(nbytes: int) -> np.ndarray:
    size = -(-nbytes // _HUGE) * _HUGE
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages off, or not this kernel: small pages
            pass
    return np.frombuffer(area, dtype=np.uint8)


class FreshMemory:
    """Hands out uninitialised, writable byte arrays cut from large anonymous mappings."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self._area: np.ndarray | None = None
        self._at = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable ``uint8`` array of ``nbytes`` bytes, 64-byte aligned, not zeroed."""
        step = -(-nbytes // ALIGN) * ALIGN
        if self._area is None or self._at + step > self._area.nbytes:
            if step > self.block // 4:  # a large tensor: a mapping of its own
                return _mapping(step)[:nbytes]
            self._area, self._at = _mapping(self.block), 0
        out = self._area[self._at : self._at + nbytes]
        self._at += step
        return out
