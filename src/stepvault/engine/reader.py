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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..errors import CorruptObjectError, MissingObjectError
from ..format.dtypes import dtype_info
from ..format.encoding import torch_dtype, torch_dtype_name
from ..format.hashing import one_thread_per_hash
from ..format.manifest import Manifest, TensorEntry
from ..format.objects import ObjectHeader, decode_object, parse_header
from ..format.xor_codec import MAX_CHAIN
from ..store import Store
from .copying import parallel_copy
from .fresh_memory import FreshMemory
from .writer import default_workers

if TYPE_CHECKING:
    import torch

# torch (and .staging, which needs it) is imported where tensors are built, not here:
# listing and inspecting a store reads manifests through this module without torch.


#: How a read verifies objects: ``"fast"`` with their segment checksums where recorded
#: (BLAKE3 otherwise), ``"full"`` always with BLAKE3 (signed checkpoints, ``verify --deep``).
VerifyMode = Literal["fast", "full"]
VERIFY_MODES = ("fast", "full")

#: Bytes a whole-checkpoint read fetches ahead of verification (memory for remote objects,
#: page cache for mapped local ones).
DEFAULT_READ_AHEAD = 512 << 20


def check_verify_mode(verify: str) -> VerifyMode:
    """``verify`` if it is a known mode, else a ValueError naming the choices."""
    if verify not in VERIFY_MODES:
        raise ValueError(
            f"verify={verify!r}: use 'fast' (segment checksums where recorded, the default) "
            "or 'full' (BLAKE3 of every byte)"
        )
    return verify  # type: ignore[return-value]


def is_signed(store: Store, run: str, step: int) -> bool:
    """Whether ``run@step`` has a signature record in ``store`` (any tier of a view); an
    unreadable one counts as signed (the careful reading)."""
    try:
        return store.read_signature(run, step) is not None
    except Exception:  # any doubt reads with BLAKE3
        return True


def read_object_bytes(store: Store, digest: str) -> memoryview | bytes:
    """The stored (encoded) bytes of one object: a private map on local disk (the kernel
    reads it ahead), else the downloaded bytes. Errors are store errors of the object."""
    try:
        buf: memoryview | bytes | None = store.map_object(digest)
        if buf is None:
            buf = store.read_object(digest)
        return buf
    except FileNotFoundError:
        raise MissingObjectError(
            f"object {digest[:16]}… is missing from {store.backend.url}"
        ) from None
    except OSError as exc:
        # ELOOP (a symlink planted in the store), EISDIR, EACCES...: never followed, never
        # fatal to the fallback logic; the object is simply unusable.
        err = CorruptObjectError(f"object {digest[:16]}… cannot be read safely: {exc}")
        err.digest = digest
        raise err from None


def fetch_object(
    store: Store,
    digest: str,
    *,
    verify: bool = True,
    max_chain: int = MAX_CHAIN,
    fast: bool = False,
    buf: memoryview | bytes | None = None,
) -> memoryview:
    """Decoded, verified bytes of one object (a private copy-on-write map when raw on disk).

    ``fast``: verify with the object's segment checksums where it has them (BLAKE3
    otherwise); ``buf``: its stored bytes, already read (:func:`read_object_bytes`). A
    delta object's base is fetched from ``store`` too (through a tier view: from any
    tier), verified, with a chain at most ``max_chain`` links long."""
    if buf is None:
        buf = read_object_bytes(store, digest)
    try:
        raw = decode_object(
            buf,
            digest,
            verify=verify,
            base=base_reader(store, fast=fast),
            max_chain=max_chain,
            fast=fast,
        )
    except CorruptObjectError as exc:
        if exc.digest is None:  # a damaged base keeps its own name: that one is set aside
            exc.digest = digest
        raise
    if raw.readonly:
        raw = memoryview(bytearray(raw))
    return raw


def base_reader(store: Store, *, fast: bool = False) -> Callable[[str, int], memoryview]:
    """Reads delta bases from ``store`` (for :func:`~stepvault.format.objects.decode_object`)."""
    return lambda digest, max_chain: fetch_object(store, digest, max_chain=max_chain, fast=fast)


#: Segments each thread checks, at least, when a partial read spreads its checks.
_SEGMENTS_PER_THREAD = 4
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _segment_pool() -> ThreadPoolExecutor:
    """Threads that check the segments of one large partial read (made once, kept)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=default_workers(), thread_name_prefix="stepvault-verify"
            )
        return _pool


class _ByteBudget:
    """At most ``limit`` bytes taken at once (one item of any size when none is taken),
    granted in order: item ``seq`` only after item ``seq - 1``. In order, because the
    verifiers consume in order: were a later read granted first, the budget could fill
    with objects no verifier reaches while the one they wait for can never be read.
    :meth:`stop` wakes every waiter for good (a failed read ends the pipeline)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.next = 0
        self.stopped = False
        self._cond = threading.Condition()

    def take(self, seq: int, n: int) -> bool:
        with self._cond:
            while not self.stopped and (
                seq != self.next or (self.taken and self.taken + n > self.limit)
            ):
                self._cond.wait()
            if self.stopped:
                return False
            self.taken += n
            self.next += 1
            self._cond.notify_all()
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self.taken -= n
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


class _Partial:
    """A raw object mapped but not verified whole: the segments verified so far."""

    __slots__ = ("header", "raw", "verified")

    def __init__(self, header: ObjectHeader, raw: memoryview) -> None:
        self.header = header
        self.raw = raw
        self.verified: set[int] = set()


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
        self._partial: dict[str, _Partial | None] = {}
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
        if not todo:
            return
        sizes = {d: e.size for d, e in self.manifest.objects.items()}
        total, done = sum(sizes.get(d, 0) for d in todo), 0
        # With at least one object per thread the pool keeps every core busy; BLAKE3's own
        # threads are for fewer, larger objects.
        spread = len(todo) >= self.workers
        budget = _ByteBudget(self.read_ahead)

        def read(seq: int, digest: str) -> memoryview | bytes | None:
            if not budget.take(seq, sizes.get(digest, 0)):
                return None  # the pipeline stopped (an earlier object failed)
            return read_object_bytes(self.store, digest)

        def verify(digest: str, fetched: Future[memoryview | bytes | None]) -> memoryview:
            try:
                buf = fetched.result()
                if buf is None:
                    raise CorruptObjectError("the read pipeline stopped")
                if not spread:
                    return fetch_object(self.store, digest, fast=self.fast, buf=buf)
                with one_thread_per_hash():
                    return fetch_object(self.store, digest, fast=self.fast, buf=buf)
            finally:
                budget.give(sizes.get(digest, 0))

        # Reads wait on the device (or the network), not on a core: more of them than
        # verifier threads keeps the storage busy.
        readers = ThreadPoolExecutor(max_workers=max(4, 2 * self.workers))
        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                reads = [readers.submit(read, i, d) for i, d in enumerate(todo)]
                checks = [pool.submit(verify, d, f) for d, f in zip(todo, reads)]
                for digest, check in zip(todo, checks):
                    try:
                        raw = check.result()
                    except BaseException:
                        budget.stop()
                        for c in checks:
                            c.cancel()
                        raise
                    self._objects[digest] = raw
                    self._partial.pop(digest, None)
                    if progress is not None:
                        done += sizes.get(digest, 0)
                        progress(done, total)
        finally:
            budget.stop()
            readers.shutdown(wait=True, cancel_futures=True)

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

    def _partial_object(self, digest: str) -> _Partial | None:
        if digest in self._partial:
            return self._partial[digest]
        found: _Partial | None = None
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
                found = _Partial(header, memoryview(mapped)[header.payload_offset :])
        with self._lock:
            self._partial[digest] = found
        return found

    def _check_piece(self, digest: str, partial: _Partial, off: int, length: int) -> memoryview:
        from ..format.hashing import check_segments

        sums = partial.header.sums
        assert sums is not None
        wanted = [i for i in sums.segments(off, length) if i not in partial.verified]
        if wanted:
            first, last = wanted[0], wanted[-1]
            # Many segments (a large tensor): spread over the cores (xxhash releases the
            # GIL); a few: here, a pool hop costs more than it saves.
            groups = min(self.workers, (last - first + 1) // _SEGMENTS_PER_THREAD)
            if groups < 2:
                bad = check_segments(partial.raw, sums.hex, sums.segment, first, last)
            else:
                step = -(-(last - first + 1) // groups)
                spans = [(a, min(last, a + step - 1)) for a in range(first, last + 1, step)]
                found = _segment_pool().map(
                    lambda span: check_segments(
                        partial.raw, sums.hex, sums.segment, span[0], span[1]
                    ),
                    spans,
                )
                bad = next((b for b in found if b is not None), None)
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
