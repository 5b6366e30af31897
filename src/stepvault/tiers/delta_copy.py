"""Lossless deltas for cold tiers: the ``xor`` tier codec of a checkpoint copy.

When a checkpoint moves into a tier whose codec is ``xor`` (or ``xor:K``), each object the
tier lacks is also encoded as the XOR against the object at the same place (same tensor,
same chunk index) in the newest older checkpoint of the run *that the tier already
holds*, and the delta is kept only where it is smaller than the object's best plain
encoding (``auto``). So a base is always in the target tier before a delta naming it is
written (bases before deltas), and a chain grows only while the deltas pay off: an
object whose base already has ``K`` links is stored plain, which bounds what a restore
replays.

Every manifest that references a delta object also lists that object's whole base chain
in its ``objects`` table: GC marks from manifests, so it keeps every base a kept delta
needs, in every tier, with no special case; a byte-for-byte copy of the checkpoint to
another tier carries the bases along; ``verify`` checks them.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ..catalog.commit import object_entry, read_header
from ..engine import fetch_object
from ..errors import StepvaultError
from ..format import parse_manifest
from ..format.hashing import segment_sums
from ..format.manifest import Manifest, ObjectEntry
from ..format.objects import EncodedObject, frame_object
from ..format.xor_codec import XOR_ID, chain_of, encode_xor
from ..store import Store

#: Written into a store before its first delta object: byte-for-byte copies into such a
#: store check whether an object they reuse is a delta (and list its bases).
DELTA_MARKER = "deltas.json"


def _previous(dst: Store, run: str, step: int) -> Manifest | None:
    older = [s for s in dst.list_steps(run) if s < step]
    if not older:
        return None
    try:
        return parse_manifest(dst.read_manifest(run, older[-1]), f"{run}@{older[-1]}")
    except StepvaultError:
        return None  # unreadable: no bases from it (plain objects are always correct)


class DeltaCopy:
    """Per-object xor-or-plain choice for one checkpoint copy into ``dst`` (thread-safe).

    ``bases`` collects, for the new manifest, the table entries of every base chain that
    a delta object of the checkpoint needs (new deltas and reused ones alike).
    """

    def __init__(
        self, src: Store, dst: Store, run: str, step: int, manifest: Manifest, limit: int
    ) -> None:
        self.src, self.dst, self.limit = src, dst, limit
        self.bases: dict[str, ObjectEntry] = {}
        self._lock = threading.Lock()
        self._marked = False
        self._base_of: dict[str, str] = {}
        prev = _previous(dst, run, step)
        if prev is None:
            return
        for name, entry in manifest.tensors.items():
            old = prev.tensors.get(name)
            if old is None:
                continue
            for i, (digest, off, _) in enumerate(entry.chunks):
                if i < len(old.chunks) and off == 0 and old.chunks[i][1] == 0:
                    self._base_of.setdefault(digest, old.chunks[i][0])

    def note_reused(self, digest: str, header: Any) -> None:
        """An object ``dst`` already holds: if it is a delta, list its bases too."""
        if header.codec == XOR_ID:
            self._add_chain(chain_of(header.params))

    def _add_chain(self, chain: list[str]) -> None:
        entries = {h: object_entry(self.dst, h) for h in chain if h not in self.bases}
        for h in chain:
            self.dst.touch_object(h)  # in use again: GC's grace period covers the copy
        with self._lock:
            self.bases.update(entries)

    def encode(
        self, digest: str, raw: memoryview, dtype: str | None, plain: EncodedObject
    ) -> EncodedObject:
        """``plain``, or the xor delta of ``raw`` against its base when that is smaller."""
        base = self._base_of.get(digest)
        if base is None or base == digest:
            return plain
        try:
            head = read_header(self.dst, base)
        except (FileNotFoundError, StepvaultError):
            return plain  # the base is not (readable) in this tier: never a dangling delta
        chain = [base, *(chain_of(head.params) if head.codec == XOR_ID else [])]
        if len(chain) > self.limit or head.raw_size != raw.nbytes:
            return plain  # a full object every K links: a restore never replays more
        base_raw = self._base_bytes(base)
        if base_raw is None or base_raw.nbytes != raw.nbytes:
            return plain
        parts, params = encode_xor(raw, base_raw, chain, dtype)
        sums = segment_sums(raw)  # a delta is verified on read as cheaply as a plain object
        delta = frame_object(digest, XOR_ID, raw.nbytes, params, parts, sums=sums)
        if delta.size >= plain.size:
            return plain
        self._mark()
        self._add_chain(chain)
        return delta

    def _base_bytes(self, base: str) -> memoryview | None:
        # The source usually holds the base plain (hot tier): cheaper than replaying the
        # target's chain. Content addressing makes every copy the same bytes.
        for store in (self.src, self.dst):
            try:
                return fetch_object(store, base)
            except StepvaultError:
                continue
        return None

    def _mark(self) -> None:
        with self._lock:
            if self._marked:
                return
            self._marked = True
        if not self.dst.backend.exists(DELTA_MARKER):
            doc = {"codec": XOR_ID, "note": "this store holds xor delta objects (FORMAT.md)"}
            self.dst.backend.put_atomic(DELTA_MARKER, [json.dumps(doc).encode()], overwrite=True)

    def check_bases(self) -> None:
        """Right before the commit: every listed base is still in the tier."""
        for h in self.bases:
            if not self.dst.has_object(h):
                raise StepvaultError(
                    f"base object {h[:16]}… of a delta vanished from {self.dst.backend.url} "
                    "during the copy (a concurrent GC?); nothing was committed, retry the move"
                )
