"""Copy one committed checkpoint from one tier's store to another's, crash-consistently.

Order, the same as a save: (1) every object the target lacks is read from the source,
decoded and hash-verified (damage never spreads to the archive), optionally re-encoded,
and written under its hash; objects the target already holds are only touched (dedup
within the tier; the touch keeps GC's grace period from racing the copy); (2) run
metadata, signature and lineage records follow; (3) the manifest is committed with
create-if-absent. Until (3) the checkpoint does not exist in the target; after it, it is
complete. A crash anywhere leaves at most unreferenced objects, which GC reclaims.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..engine.fetch import base_reader
from ..errors import CheckpointExistsError, CorruptObjectError, MissingObjectError, StepvaultError
from ..format import parse_manifest
from ..format.codecs import choose_codec
from ..format.manifest import ObjectEntry, serialize_manifest
from ..format.objects import EncodedObject, decode_object, encode_object, parse_header
from ..format.xor_codec import chain_limit
from ..store import Store
from .delta_copy import DELTA_MARKER, DeltaCopy, read_header

#: Objects in flight at once: object stores reward many parallel requests.
DEFAULT_COPY_WORKERS = 16


@dataclass
class CopyStats:
    run: str
    step: int
    objects: int = 0
    copied_objects: int = 0
    reused_objects: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    already_there: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _dtypes(manifest: Any) -> dict[str, str | None]:
    """Object hash -> dtype of its contents (None when tensors of several dtypes share it)."""
    out: dict[str, str | None] = {}
    for entry in manifest.tensors.values():
        for digest, _, _ in entry.chunks:
            out[digest] = entry.dtype if out.get(digest, entry.dtype) == entry.dtype else None
    return out


def copy_checkpoint(
    src: Store,
    dst: Store,
    run: str,
    step: int,
    *,
    codec: str = "keep",
    workers: int = DEFAULT_COPY_WORKERS,
    before_commit: Any = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> CopyStats:
    """Copy ``run@step`` from ``src`` to ``dst`` (objects first, manifest last).

    ``codec="keep"`` copies stored objects byte for byte (the manifest stays identical,
    unless it reuses a delta object of ``dst``: then it also lists that delta's bases);
    another codec re-encodes objects that ``dst`` lacks; ``"xor"``/``"xor:K"`` also
    stores them as deltas against the tier's previous checkpoint where that is smaller
    (:mod:`.delta_copy`). Returns with ``already_there``
    when ``dst`` already holds the checkpoint. ``progress(done, total)`` gets the stored
    bytes of the objects handled so far (copied or already there). Raises
    CorruptObjectError/MissingObjectError (nothing committed) when the source is damaged.
    """
    t0 = time.perf_counter()
    stats = CopyStats(run, step)
    key = Store.manifest_key(run, step)
    if dst.backend.exists(key):
        stats.already_there = True
        return stats
    raw_manifest = src.read_manifest(run, step)
    manifest = parse_manifest(raw_manifest, f"{run}@{step}")
    signature_key = f"runs/{run}/checkpoints/{step}.sig"
    try:
        signature = src.backend.read_bytes(signature_key)
    except FileNotFoundError:
        signature = None
    if signature is not None:
        codec = "keep"  # re-encoding would change the signed manifest bytes
    dtypes = _dtypes(manifest)
    changed: dict[str, ObjectEntry] = {}
    limit = chain_limit(codec)
    plain_codec = "auto" if limit else codec
    # Deltas are written by an xor tier copy; a byte-for-byte copy into a store that holds
    # some still lists the bases of any delta it reuses (GC marks from manifests).
    deltas = None
    if limit or dst.backend.exists(DELTA_MARKER):
        deltas = DeltaCopy(src, dst, run, step, manifest, limit or 0)

    def one(digest: str) -> tuple[int, int, bool]:
        try:
            size = dst.object_size(digest)
        except FileNotFoundError:
            size = None
        if size is not None:
            dst.touch_object(digest)
            if codec != "keep" or deltas is not None:
                head = read_header(dst, digest)
                if codec != "keep":
                    changed[digest] = ObjectEntry(head.codec, size, 0)
                if deltas is not None:
                    deltas.note_reused(digest, head)
            return 0, 0, False
        try:
            data = src.read_object(digest)
        except FileNotFoundError:
            raise MissingObjectError(
                f"{run}@{step}: object {digest[:16]}… is missing from {src.backend.url}; "
                "nothing was committed in the target"
            ) from None
        try:
            raw = decode_object(data, digest, verify=True, base=base_reader(src))
        except CorruptObjectError as exc:
            if exc.digest is None:
                exc.digest = digest
            raise
        parts: list[Any] = [data]
        if codec != "keep":
            header = parse_header(data)
            target = choose_codec(plain_codec, dtypes.get(digest))
            if header.codec != target:
                enc = encode_object(raw, target, dtypes.get(digest), digest)
                parts = enc.parts
            if limit and deltas is not None:
                plain = EncodedObject(digest, target, raw.nbytes, parts)
                parts = deltas.encode(digest, raw, dtypes.get(digest), plain).parts
            written = sum(memoryview(p).nbytes for p in parts)
            changed[digest] = ObjectEntry(parse_header(parts[0]).codec, written, raw.nbytes)
        dst.put_object(digest, parts)
        return len(data), sum(memoryview(p).nbytes for p in parts), True

    digests = list(manifest.objects)
    stats.objects = len(digests)
    if digests:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(digests)))) as pool:
            total, done = sum(manifest.objects[d].size for d in digests), 0
            for digest, (nread, nwritten, new) in zip(digests, pool.map(one, digests)):
                done += manifest.objects[digest].size
                if progress is not None:
                    progress(done, total)
                stats.bytes_read += nread
                stats.bytes_written += nwritten
                stats.copied_objects += new
                stats.reused_objects += not new
    data = raw_manifest
    bases = {} if deltas is None else deltas.bases
    new_bases = {h: e for h, e in bases.items() if h not in manifest.objects}
    if new_bases and signature is not None:
        raise StepvaultError(
            f"{run}@{step} is signed, and {dst.backend.url} holds some of its objects as xor "
            "deltas whose bases a signed manifest cannot list; copy signed runs to a tier "
            "whose codec is not xor. Nothing was committed in the target"
        )
    if changed or new_bases:
        for digest, entry in changed.items():
            old = manifest.objects[digest]
            manifest.objects[digest] = ObjectEntry(entry.codec, entry.size, old.raw_size)
        manifest.objects.update(new_bases)
        data = serialize_manifest(manifest)
    info = src.read_run_info(run) or {"run": run, "created": manifest.created}
    dst.ensure_run(run, info)
    if manifest.lineage:
        _copy_key(src, dst, f"runs/{run}/lineage/{manifest.lineage}.json")
    if signature is not None:
        dst.backend.put_atomic(signature_key, [signature], overwrite=True)
    dst.sync()  # every object and record durable before the manifest names them
    if deltas is not None:
        deltas.check_bases()
    if before_commit is not None:
        before_commit()
    try:
        # Straight through the backend: the bytes (and any signature) are the source's,
        # not re-signed by whoever runs the mover.
        dst.backend.put_atomic(key, [data], overwrite=False, durable=True)
    except FileExistsError:
        stats.already_there = True  # another mover committed it meanwhile: same checkpoint
    dst.sync()
    stats.bytes_written += len(data)
    stats.seconds = time.perf_counter() - t0
    return stats


def _copy_key(src: Store, dst: Store, key: str) -> None:
    if dst.backend.exists(key):
        return
    try:
        data = src.backend.read_bytes(key)
    except FileNotFoundError:
        return
    try:
        dst.backend.put_atomic(key, [data], overwrite=False)
    except FileExistsError:
        pass


def copy_pin(src: Store, dst: Store, run: str, step: int) -> None:
    """Carry a pin (or registry hold) over, so the target's retention keeps the checkpoint."""
    for prefix in (f"refs/pins/{run}", f"refs/holds/{run}"):
        for name in src.backend.list(prefix):
            if name == f"{step}.json" or name.startswith(f"{step}@"):
                _copy_key(src, dst, f"{prefix}/{name}")


__all__ = ["CheckpointExistsError", "CopyStats", "copy_checkpoint", "copy_pin"]
