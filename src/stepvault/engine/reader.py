"""The read path: plan → fetch → verify → decode → place.

Every object is verified after decoding before any byte of it is used: by its segment
checksums (xxh3-128, recorded at save; ``verify="fast"``, the default) or by re-hashing
it with BLAKE3 and comparing with its name (``verify="full"``, and objects written
without checksums). A partial read (one tensor) verifies only the segments it uses. Raw
objects on local disk are memory-mapped, so a tensor that lives in one object is a
zero-copy view. Tensors handed out never alias each other, even when deduplication made
two of them share one object.

A whole-checkpoint read (:meth:`CheckpointReader.prefetch`) is a pipeline: reader threads
fetch the next objects (a local object is mapped with a kernel read-ahead; a remote one
is downloaded) while the verifier threads check the ones already fetched, with at most
``read_ahead`` bytes fetched and not yet verified.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptObjectError
from ..format.dtypes import dtype_info
from ..format.encoding import torch_dtype, torch_dtype_name
from ..format.manifest import Manifest, TensorEntry
from ..format.objects import parse_header
from ..store import Store
from .copying import parallel_copy
from .fetch import (
    DEFAULT_READ_AHEAD,
    PartialObject,
    VerifyMode,
    check_segment_range,
    check_verify_mode,
    fetch_object,
    fetch_pipelined,
    is_signed,
)
from .fresh_memory import FreshMemory
from .writer import default_workers

if TYPE_CHECKING:
    import torch

# torch (and .staging, which needs it) is imported where tensors are built, not here:
# listing and inspecting a store reads manifests through this module without torch.


def is_mapped(view: memoryview) -> bool:
    """Whether ``view`` is (a slice of) a store object's memory map, not fresh memory."""
    return isinstance(view.obj, mmap.mmap)


class PendingArray:
    """A stored tensor/array not read yet (resolved by :meth:`CheckpointReader.read` or
    placed straight into a live tensor with :meth:`CheckpointReader.read_into`)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    def __repr__(self) -> str:
        return f"<pending {self.kind} {self.name}>"


class CheckpointReader:
    """Reads tensors of one committed checkpoint, lazily or all at once."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        *,
        workers: int | None = None,
        verify: VerifyMode = "fast",
        read_ahead: int = DEFAULT_READ_AHEAD,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.workers = workers or default_workers()
        #: "fast": segment checksums where recorded; "full": BLAKE3 of every object (always
        #: for a signed checkpoint, whatever was asked: its signature covers BLAKE3 names,
        #: and a non-cryptographic checksum could be forged to match altered bytes)
        self.verify: VerifyMode = check_verify_mode(verify)
        if self.verify == "fast" and is_signed(store, manifest.run, manifest.step):
            self.verify = "full"
        #: bytes fetched ahead of verification in :meth:`prefetch`
        self.read_ahead = read_ahead
        self._objects: dict[str, memoryview] = {}
        self._partial: dict[str, PartialObject | None] = {}
        self._handed_out: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()

    @property
    def fast(self) -> bool:
        return self.verify == "fast"

    def prefetch(
        self,
        digests: Iterable[str],
        progress: Callable[[int, int | None], None] | None = None,
    ) -> None:
        """Fetch and verify objects, pipelined (raises on the first damaged one);
        ``progress(done, total)`` gets the stored bytes verified so far.

        Reader threads fetch objects in order, at most :attr:`read_ahead` bytes ahead of
        the verifier threads, which check each one as soon as it is there: the reads of
        the next objects overlap the verification of the current ones (a cold restore is
        bound by the storage, not by read + verify one after the other)."""
        todo = [d for d in dict.fromkeys(digests) if d not in self._objects]
        sizes = {d: e.size for d, e in self.manifest.objects.items()}

        def verified(digest: str, raw: memoryview) -> None:
            self._objects[digest] = raw
            self._partial.pop(digest, None)

        fetch_pipelined(
            self.store,
            todo,
            sizes,
            workers=self.workers,
            read_ahead=self.read_ahead,
            fast=self.fast,
            verified=verified,
            progress=progress,
        )

    def _object(self, digest: str) -> memoryview:
        raw = self._objects.get(digest)
        if raw is None:
            raw = self._objects[digest] = fetch_object(self.store, digest, fast=self.fast)
        return raw

    def _piece(self, digest: str, off: int, length: int) -> memoryview:
        """Verified bytes ``off .. off+length`` of an object's decoded content.

        An object verified whole is sliced; otherwise a raw, mapped object with segment
        checksums has only the segments covering the piece verified (a partial read, e.g.
        one tensor of a bundle), anything else is fetched and verified whole."""
        raw = self._objects.get(digest)
        if raw is None and self.fast:
            partial = self._partial_object(digest)
            if partial is not None:
                return self._check_piece(digest, partial, off, length)
        return self._object(digest)[off : off + length]

    def _partial_object(self, digest: str) -> PartialObject | None:
        if digest in self._partial:
            return self._partial[digest]
        found: PartialObject | None = None
        try:
            mapped = self.store.map_object(digest)  # None where the backend cannot map
        except OSError:
            mapped = None  # missing or unreadable: the whole-object fetch says which
        if mapped is not None:
            try:
                header = parse_header(mapped)
            except CorruptObjectError as exc:
                exc.digest = digest
                raise
            if header.codec == "raw" and header.sums is not None and header.sums.usable():
                if header.raw_blake3 != digest:
                    err = CorruptObjectError(
                        f"object {digest[:16]}… header names a different hash "
                        f"({header.raw_blake3[:16]}…)"
                    )
                    err.digest = digest
                    raise err
                if len(mapped) != header.payload_offset + header.raw_size:
                    err = CorruptObjectError(
                        f"object {digest[:16]}…: {len(mapped)} bytes stored, the header "
                        f"says {header.payload_offset + header.raw_size} (truncated or damaged)"
                    )
                    err.digest = digest
                    raise err
                found = PartialObject(header, memoryview(mapped)[header.payload_offset :])
        with self._lock:
            self._partial[digest] = found
        return found

    def _check_piece(
        self, digest: str, partial: PartialObject, off: int, length: int
    ) -> memoryview:
        sums = partial.header.sums
        assert sums is not None
        wanted = [i for i in sums.segments(off, length) if i not in partial.verified]
        if wanted:
            bad = check_segment_range(partial.raw, sums, wanted[0], wanted[-1], self.workers)
            if bad is not None:
                err = CorruptObjectError(
                    f"object {digest[:16]}… content does not match its hash (the xxh3-128 "
                    f"checksum of segment {bad} differs: bit rot or tampering)"
                )
                err.digest = digest
                raise err
            with self._lock:
                partial.verified.update(wanted)
        return partial.raw[off : off + length]

    def _range(self, digest: str, off: int, length: int) -> memoryview:
        view = self._piece(digest, off, length)
        if view.nbytes != length:
            raise CorruptObjectError(f"object {digest[:16]}… is shorter than the manifest says")
        key = (digest, off, length)
        with self._lock:
            shared = key in self._handed_out
            self._handed_out.add(key)
        # The same bytes handed out twice (dedup) must not become two aliasing tensors.
        return memoryview(bytearray(view)) if shared else view

    def read(self, name: str, *, private: bool = False) -> Any:
        """One tensor (torch) or array (numpy), verified; reads only the objects it needs.

        A tensor that lies in one raw object on local disk is a view of that object's
        copy-on-write mapping; ``private=True`` copies it into fresh memory instead.
        """
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise KeyError(
                f"no tensor {name!r} in {self.manifest.run}@{self.manifest.step}; "
                f"it has {len(self.manifest.tensors)} tensors (see .tensor_names())"
            )
        return self._build(entry, private=private)

    def meta(self, name: str) -> Any:
        """A zero-memory stand-in with the stored shape and dtype (for validation)."""
        import torch

        entry = self.manifest.tensors[name]
        if entry.kind == "ndarray":
            one = np.zeros(1, dtype=dtype_info(entry.dtype).numpy)
            return np.lib.stride_tricks.as_strided(one, entry.shape, [0] * len(entry.shape))
        return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype), device="meta")

    def read_into(
        self,
        name: str | TensorEntry,
        dst: torch.Tensor,
        *,
        copies: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> bool:
        """Copy a verified tensor (by name, or a TensorEntry such as a shard) straight into
        ``dst`` (no intermediate buffer).

        Returns False, touching nothing, when ``dst`` does not fit (shape, dtype, layout).
        With ``copies`` the host-to-host byte copies are appended there instead of run
        (the caller runs them all at once with :func:`~stepvault.engine.copying.
        parallel_copy`, spread over the cores); copies to other devices run here.
        """
        import torch

        entry = name if isinstance(name, TensorEntry) else self.manifest.tensors[name]
        if (
            entry.kind != "tensor"
            or tuple(dst.shape) != tuple(entry.shape)
            or torch_dtype_name(dst.dtype) != entry.dtype
            or not dst.is_contiguous()
            or dst.layout != torch.strided
        ):
            return False
        if entry.nbytes == 0:
            return True
        flat = dst.detach().reshape(-1).view(torch.uint8)
        # numpy's copy releases the GIL and runs at memory speed (torch's copy_ was 2-4x
        # slower for plain CPU byte copies here); other devices go through torch.
        host = flat.numpy() if flat.device.type == "cpu" else None
        at = 0
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        with torch.no_grad():
            for digest, off, length in entry.chunks:
                src = self._piece(digest, off, length)
                if src.nbytes != length:
                    raise CorruptObjectError(f"object {digest[:16]}… is shorter than expected")
                if host is not None:
                    pairs.append((host[at : at + length], np.frombuffer(src, dtype=np.uint8)))
                else:
                    flat[at : at + length].copy_(torch.frombuffer(src, dtype=torch.uint8))
                at += length
        if copies is not None:
            copies.extend(pairs)
        else:
            parallel_copy(pairs)
        return True

    def read_fresh(
        self,
        name: str,
        *,
        copies: list[tuple[np.ndarray, np.ndarray]] | None = None,
        memory: FreshMemory | None = None,
    ) -> Any:
        """One tensor or array in fresh memory of its own, never a view of a stored object.

        For the state a restore hands to training (optimizer moments, plain tensors): a
        view of a private file mapping would copy each page on its first write inside the
        training step, one page fault at a time, and would keep the object's file (on a
        tmpfs mem tier: its memory) alive as long as the tensor lives. The memory comes
        from ``memory`` (uninitialised, huge pages where the kernel gives them); with
        ``copies`` the byte copies are appended there (the caller runs them with
        :func:`~stepvault.engine.copying.parallel_copy`), otherwise they run now.
        """
        entry = self.manifest.tensors[name]
        if entry.nbytes == 0:
            return self._build(entry)
        buf = (memory or FreshMemory()).take(entry.nbytes)
        pairs = self._chunk_copies(entry, buf)
        if copies is not None:
            copies.extend(pairs)
        else:
            parallel_copy(pairs)
        from .staging import from_bytes

        return from_bytes(entry.kind, entry.dtype, entry.shape, buf)

    def _build(self, entry: TensorEntry, *, private: bool = False) -> Any:
        if len(entry.chunks) == 1:
            data = self._range(*entry.chunks[0])
            if private and is_mapped(data):
                data = memoryview(bytearray(data))
        else:
            # Uninitialised memory and the cores' parallel copy: a bytearray is zero-filled
            # first, and slice assignment copies on one thread (1 GB of AdamW moments took
            # 2 s that way here, against 0.5 s for placing the same bytes).
            buf = np.empty(entry.nbytes, dtype=np.uint8)
            parallel_copy(self._chunk_copies(entry, buf))
            data = memoryview(buf.data)
        from .staging import from_bytes

        return from_bytes(entry.kind, entry.dtype, entry.shape, data)

    def _chunk_copies(
        self, entry: TensorEntry, buf: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(destination slice of ``buf``, stored chunk bytes) for each chunk of ``entry``."""
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        at = 0
        for digest, off, length in entry.chunks:
            src = self._piece(digest, off, length)
            if src.nbytes != length:
                raise CorruptObjectError(f"object {digest[:16]}… is shorter than expected")
            pairs.append((buf[at : at + length], np.frombuffer(src, dtype=np.uint8)))
            at += length
        return pairs

    def read_sharded(self, fqn: str) -> Any:
        """A tensor of a multi-rank checkpoint, assembled from its shards (verified)."""
        import torch

        sharded = self.manifest.sharded or {"entries": {}}
        e = sharded["entries"].get(fqn)
        if e is None or e["type"] != "tensor":
            raise KeyError(f"no sharded tensor {fqn!r} in {self.manifest.run}@{self.manifest.step}")
        full = torch.empty(e["size"], dtype=torch_dtype(e["dtype"]))
        for sh in e["shards"]:
            piece = self._build(
                TensorEntry(e["dtype"], list(sh["sizes"]), [tuple(c) for c in sh["chunks"]])
            )
            box = full
            for dim, (off, length) in enumerate(zip(sh["offsets"], sh["sizes"])):
                box = box.narrow(dim, off, length)
            box.copy_(piece)
        return full

    def read_all(self, *, private: bool = False) -> dict[str, Any]:
        """Every tensor of the checkpoint, all objects verified before any is returned
        (``private``: as in :meth:`read`)."""
        self.prefetch(d for t in self.manifest.tensors.values() for d, _, _ in t.chunks)
        return {
            name: self._build(entry, private=private)
            for name, entry in self.manifest.tensors.items()
        }

    def release(self) -> None:
        """Drop cached objects (the tensors already handed out stay valid)."""
        self._objects.clear()
        self._partial.clear()

    def drop(self, digests: Iterable[str]) -> None:
        """Forget these objects (a streaming export: no later tensor needs them)."""
        with self._lock:
            for digest in digests:
                self._objects.pop(digest, None)
                self._partial.pop(digest, None)
