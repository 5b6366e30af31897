"""Reusable host buffers for asynchronous saves.

Copying a state into buffers that already exist runs at memory speed; allocating fresh
ones page-faults every byte and is ~20x slower (measured: 0.12 s vs 2.6 s for 1.5 GB), so
buffers are allocated once per tensor name and reused by every later save. With CUDA they
are pinned, so device-to-host copies are asynchronous DMA.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..format.dtypes import dtype_from_numpy
from ..format.encoding import torch_dtype_name
from .staging import HostArray

_COPY_POOL: ThreadPoolExecutor | None = None


def _parallel_copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy (dst, src) byte arrays, spread over the cores when there is enough to copy."""
    global _COPY_POOL
    total = sum(src.nbytes for _, src in pairs)
    if total < (64 << 20) or len(pairs) < 2:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    if _COPY_POOL is None:
        _COPY_POOL = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 2), thread_name_prefix="stepvault-stage"
        )
    list(_COPY_POOL.map(lambda pair: np.copyto(*pair), pairs))


class StagingArea:
    """Per-name host buffers, reused across saves (one save may use them at a time)."""

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory held for staging."""
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            self._buffers[name] = buf
        return buf

    def stage(self, arrays: dict[str, Any]) -> dict[str, HostArray]:
        """Copy every tensor/array into its buffer; returns host views of the copies."""
        out: dict[str, HostArray] = {}
        needs_sync = False
        host_copies: list[tuple[np.ndarray, np.ndarray]] = []
        for name, value in arrays.items():
            if isinstance(value, torch.Tensor):
                t = value.detach()
                buf = self._buffer(name, t.numel() * t.element_size())
                if t.numel() and t.device.type == "cpu" and t.is_contiguous():
                    # numpy's copy runs at memory speed and releases the GIL; torch's copy_
                    # measured 2-4x slower for plain CPU byte copies on these machines.
                    host_copies.append((buf.numpy(), t.reshape(-1).view(torch.uint8).numpy()))
                elif t.numel():
                    dst = buf.view(t.dtype).view(t.shape)
                    dst.copy_(t, non_blocking=t.device.type == "cuda")
                    needs_sync |= t.device.type == "cuda"
                view = memoryview(buf.numpy()).cast("B")
                out[name] = HostArray("tensor", torch_dtype_name(t.dtype), list(t.shape), view)
            else:
                arr = np.asarray(value)
                dt = dtype_from_numpy(arr.dtype)
                buf = self._buffer(name, arr.nbytes)
                dst = buf.numpy().view(arr.dtype.newbyteorder("<")).reshape(arr.shape)
                np.copyto(dst, arr)
                out[name] = HostArray("ndarray", dt, list(arr.shape), memoryview(buf.numpy()))
        _parallel_copy(host_copies)
        if needs_sync:
            torch.cuda.synchronize()
        for name in list(self._buffers):
            if name not in arrays:  # tensors that disappeared from the state
                del self._buffers[name]
        return out

    def release(self) -> None:
        """Free every buffer."""
        self._buffers.clear()
