"""Reusable host buffers for asynchronous saves.

Copying a state into buffers that already exist runs at memory speed; allocating fresh
ones page-faults every byte and is ~20x slower (measured: 0.12 s vs 2.6 s for 1.5 GB), so
buffers are allocated once per tensor name and reused by every later save. With CUDA they
are pinned, so device-to-host copies are asynchronous DMA.

The copy is the whole of an asynchronous save's stall, so it is kept to the memory copy
itself: the plan (which bytes go where) is built once per state layout and reused while
every tensor still has the same storage address, dtype and shape, and the bytes are copied
on every core (:func:`~stepvault.engine.copying.copy_spans`).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.dtypes import dtype_from_numpy
from ..format.encoding import torch_dtype_name
from .copying import PARALLEL_FROM, STAGE_PIECE, Span, copy_spans, split_spans
from .device_copy import DeviceCopies
from .staging import HostArray

#: Each buffer starts at a multiple of this inside the block (any dtype can view it).
_ALIGN = 64
#: Blocks at least this large ask the kernel for transparent huge pages (2 MiB): 512x
#: fewer page faults when the block is first written (the first save) and fewer TLB
#: misses on every copy.
_HUGE_FROM = 4 << 20
#: Tensor classes whose bytes are copied straight from their storage address; any other
#: tensor (subclasses, other devices, strided or conjugate views) goes through torch.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _host_block(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """One uint8 tensor of ``nbytes``: pinned (CUDA), else its own anonymous mapping.

    A private mapping (not the allocator's heap) is unmapped as a whole when the last
    view of it goes, and can be advised to use huge pages.
    """
    if pin_memory or nbytes == 0 or os.name == "nt":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_FROM and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off or unsupported: plain pages work the same, slower
            pass
    # The tensor holds a reference to the mapping: it is unmapped after the last view.
    return torch.frombuffer(region, dtype=torch.uint8)


#: Pre-faulting writes the block in pieces of this size, so that a caller can pause it
#: between pieces (a synchronous save should not compete with it for the cores).
_FAULT_PIECE = 64 << 20


def _itemsize(dtype: Any) -> int:
    return (
        dtype.itemsize if isinstance(dtype, (torch.dtype, np.dtype)) else np.dtype(dtype).itemsize
    )


def layout_sizes(signature: tuple) -> dict[str, int]:
    """Bytes of buffer each entry of a staging signature needs (0 for a second name of the
    same storage: tied weights are staged once)."""
    first: dict[tuple, str] = {}
    sizes: dict[str, int] = {}
    for sig in signature:
        name = sig[0]
        if sig[1] == "raw" and first.setdefault(sig[2:], name) != name:
            sizes[name] = 0
            continue
        dtype, shape = sig[-2], sig[-1]
        sizes[name] = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
    return sizes


def aligned_total(signature: tuple) -> int:
    """Bytes of the one block that stages a state with this signature."""
    return sum(_aligned(n) for n in layout_sizes(signature).values())


def signature_of(arrays: dict[str, Any]) -> tuple:
    """What a staging plan depends on, for every entry of ``arrays``."""
    return tuple(_signature(name, value) for name, value in arrays.items())


def _signature(name: str, value: Any) -> tuple:
    """What must not change for a cached copy plan to stay valid for this entry."""
    if isinstance(value, torch.Tensor):
        t = value
        if (
            type(t) in _PLAIN
            and t.is_cpu
            and t.layout == torch.strided
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and t.numel()
        ):
            # Same address, dtype and shape of a contiguous CPU tensor: the same bytes.
            return (name, "raw", t.data_ptr(), t.dtype, t.shape)
        return (name, "torch", t.dtype, t.shape)
    arr = np.asarray(value)
    return (name, "ndarray", arr.dtype, arr.shape)


@dataclass
class _Plan:
    signature: tuple
    shares: list[list[Span]]  # raw copies, in pieces that the copying threads take in turn
    others: list[str] = field(default_factory=list)  # names copied per save by torch/numpy
    out: dict[str, HostArray] = field(default_factory=dict)


class StagingArea:
    """Host buffers for every tensor of a state, reused across saves (one save may use
    them at a time).

    All buffers are views of ONE allocation: glibc serves blocks below its mmap
    threshold (up to 32 MiB) from its heap and keeps them after they are freed, so
    per-tensor buffers left ~1 GB of a GPT-2 state resident after the manager closed;
    a single large block is mapped and unmapped as a whole. (With CUDA it is pinned:
    one pinned allocation is also far cheaper than hundreds.) The block is reallocated
    only when the state's layout (names and sizes) changes.
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._block: torch.Tensor | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._sizes: dict[str, int] = {}
        self._plan: _Plan | None = None
        self._faulted = False  # every page of the block has been written once
        # prepare() may run on a background thread while stage() runs on the training one
        self._lock = threading.RLock()
        #: name of the thread that last allocated and pre-faulted the block (for tests and
        #: diagnostics: it should never be the training thread)
        self.prepared_by: str | None = None
        #: cleared to pause a running pre-fault between pieces (set again to resume)
        self.may_fault = threading.Event()
        self.may_fault.set()
        self._device = DeviceCopies()

    def ready_for(self, signature: tuple) -> bool:
        """Whether a :meth:`stage` of a state with this signature only copies (its block is
        allocated, pre-faulted and of the right layout)."""
        return self._faulted and self._block is not None and aligned_total(signature) <= self.nbytes

    def prepare(
        self, arrays: dict[str, Any], signature: tuple | None = None, *, reserve: int = 0
    ) -> None:
        """Allocate the block for a state shaped like ``arrays`` (plus ``reserve`` bytes,
        for entries not in ``arrays``) and fault in every page, so that the next
        :meth:`stage` is a plain memory copy. Meant for a background thread: it reads only
        the tensors' addresses, dtypes and shapes."""
        signature = signature_of(arrays) if signature is None else signature
        with self._lock:
            if self._plan is None or self._plan.signature != signature:
                self._plan = None
                self._plan = self._build(arrays, signature, reserve)
            if self._faulted or self._block is None:
                return
            flat = self._block.numpy()
            # One byte per 4 KiB page: the write fault maps the page (a huge page where THP
            # is on); the copy later overwrites it.
            for at in range(0, flat.size, _FAULT_PIECE):
                self.may_fault.wait()
                flat[at : at + _FAULT_PIECE : 4096] = 0
            self._faulted = True
            self.prepared_by = threading.current_thread().name

    @property
    def nbytes(self) -> int:
        """Host memory held for staging."""
        return 0 if self._block is None else self._block.numel()

    def _layout(self, sizes: dict[str, int], reserve: int = 0) -> dict[str, torch.Tensor]:
        if sizes != self._sizes:
            total = sum(_aligned(n) for n in sizes.values())
            block = self._block
            if block is None or total > block.numel():
                self.release()  # the old block goes first, so its memory can be reused
                block = _host_block(total + reserve, self.pin_memory)
                self.prepared_by = threading.current_thread().name
                # pinned memory is faulted in by cudaHostAlloc; an empty block has no pages
                self._faulted = self.pin_memory or block.numel() == 0
            # else: the layout fits the block (prepared with room for it): re-cut it
            self._buffers = {}
            at = 0
            for name, n in sizes.items():
                self._buffers[name] = block[at : at + n]
                at += _aligned(n)
            self._block, self._sizes = block, dict(sizes)
        return self._buffers

    def _build(self, arrays: dict[str, Any], signature: tuple, reserve: int = 0) -> _Plan:
        """Where each entry's bytes go (reallocating the block if the layout changed)."""
        values: dict[str, Any] = {
            name: value.detach() if isinstance(value, torch.Tensor) else np.asarray(value)
            for name, value in arrays.items()
        }
        # The same storage under two names (tied weights: an embedding and the output
        # layer) is staged once; both names view that one copy.
        first: dict[tuple, str] = {}
        alias: dict[str, str] = {}
        for sig in signature:
            if sig[1] == "raw":
                alias[sig[0]] = first.setdefault(sig[2:], sig[0])
        buffers = self._layout(layout_sizes(signature), reserve)
        spans: list[Span] = []
        plan = _Plan(signature, [])
        for sig, (name, value) in zip(signature, values.items()):
            if alias.get(name, name) != name:
                plan.out[name] = plan.out[alias[name]]
                continue
            buf = buffers[name]
            # numpy's stubs declare __buffer__ only for Python >= 3.12; ndarray has it on 3.10.
            view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
            if isinstance(value, torch.Tensor):
                if sig[1] == "raw":
                    spans.append((buf.data_ptr(), sig[2], buf.numel()))
                elif value.numel():
                    plan.others.append(name)
                plan.out[name] = HostArray(
                    "tensor", torch_dtype_name(value.dtype), list(value.shape), view
                )
            else:
                plan.others.append(name)
                dt = dtype_from_numpy(value.dtype)
                if dt is None:
                    raise TypeError(f"unsupported numpy dtype {value.dtype}")
                plan.out[name] = HostArray("ndarray", dt, list(value.shape), view)
        total = sum(n for _, _, n in spans)
        # Small states stay on the calling thread (a hand-off costs more than it saves).
        plan.shares = split_spans(spans, -(-total // STAGE_PIECE) if total >= PARALLEL_FROM else 1)
        return plan

    def stage(self, arrays: dict[str, Any]) -> dict[str, HostArray]:
        """Copy every tensor/array into its buffer; returns host views of the copies.

        When this returns the buffers hold the values of host tensors as they were at the
        call, and the copies of CUDA tensors are enqueued on a side stream that the
        current stream waits for: the caller may change the live tensors at once (later
        kernels run after the copy); read the bytes after :meth:`wait_copied`.
        """
        with self._lock:
            return self._stage(arrays, signature_of(arrays))

    def _stage(self, arrays: dict[str, Any], signature: tuple) -> dict[str, HostArray]:
        plan = self._plan
        if plan is None or plan.signature != signature:
            self._plan = None  # a failure below must not leave a half-built plan behind
            plan = self._plan = self._build(arrays, signature)
        self._faulted = True  # the copy below writes every page
        self._device.wait()  # the previous save's device copies are done with the block
        # Safe: the signature pins every raw source's address, dtype and shape (so its
        # length), ``arrays`` keeps those tensors alive for this call, and the block
        # is held by this object.
        copy_spans(plan.shares)
        on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in plan.others:
            value = arrays[name]
            buf = self._buffers[name]
            if isinstance(value, torch.Tensor):
                t = value.detach()
                dst = buf.view(t.dtype).view(t.shape)
                if t.device.type == "cuda":
                    on_device.append((dst, t))
                else:
                    dst.copy_(t)
            else:
                arr = np.asarray(value)
                dst_np = buf.numpy().view(arr.dtype.newbyteorder("<")).reshape(arr.shape)
                np.copyto(dst_np, arr)
        # Device tensors: copies enqueued on a side stream (the stall is the enqueue); the
        # writer calls wait_copied() before it reads the bytes.
        self._device.copy(on_device)
        return {
            name: HostArray(a.kind, a.dtype, list(a.shape), a.data) for name, a in plan.out.items()
        }

    def wait_copied(self) -> None:
        """Block until the device-to-host copies of the last :meth:`stage` are done (at
        once on CPU); the writer calls it before it reads the staged bytes."""
        self._device.wait()

    def release(self) -> None:
        """Free the staging memory."""
        self._device.wait()  # no copy may still be writing into the block
        pinned = self._block is not None and self.pin_memory and self._block.numel() > 0
        self._faulted = False
        self._plan = None
        self._buffers = {}
        self._sizes = {}
        self._block = None
        if pinned:
            _free_pinned_cache()


def _free_pinned_cache() -> None:
    """Hand cached pinned blocks back to the system: torch's host allocator keeps freed
    pinned memory for reuse, which would keep a released staging block resident."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        try:
            empty()
        except RuntimeError:  # no accelerator initialised: nothing cached
            pass
