"""The commit epilogue: what every save does around making its manifest visible.

Every destination that commits a manifest runs the same three steps, in this order:

1. **before the commit** (:func:`before_commit`): a light checkpoint names its base's
   chunks (the caller passes that step in: it lives in the core), then
   :func:`list_delta_bases` adds the base chain of every reused ``xor`` delta object to
   the object table, so that GC, which marks from manifests, keeps those bases;
2. **the commit**: ``serialize_manifest`` then ``Store.commit_manifest`` (atomic rename
   or create-if-absent): the checkpoint exists from here on;
3. **after the commit** (:func:`after_commit`): ``record_commit`` appends the summary row,
   so the next listing finds it without parsing the manifest; ``record_objects`` appends its
   object list, so GC's mark does not parse it either; ``remember_commit`` makes it the
   writer's next parent (no listing of the run per save).

``write_manifest`` (``core/write.py``) hands steps 1 and 3 to the engine's
``write_checkpoint``, which commits in between; the DCP writer
(``distributed/storage.py``), whose objects were written by every rank, runs all three
through :func:`commit_checkpoint`. The manifest's parent step is the caller's: it is set
before the epilogue runs. Events and hooks follow in the manager (``SavePipeline``).

This sits in the catalog (below ``tiers``, ``distributed`` and ``core``) so that every
layer that commits can use it; it needs only the store and the format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.object_lists import record_objects
from ..engine.parent import remember_commit
from ..format.manifest import Manifest, ObjectEntry, serialize_manifest
from ..format.objects import parse_header
from ..format.xor_codec import XOR_ID, chain_of
from ..store import Store
from .summaries import record_commit

_HEAD = 16384  # an object's prefix + header: a chain of 64 hashes and a stream table fit


def read_header(store: Store, digest: str) -> Any:
    """The parsed header of ``digest`` in ``store`` (one ranged read)."""
    return parse_header(store.backend.read_range(store.object_key(digest), 0, _HEAD))


def object_entry(store: Store, digest: str) -> ObjectEntry:
    """The manifest table entry of an object as ``store`` holds it."""
    head = read_header(store, digest)
    return ObjectEntry(head.codec, store.object_size(digest), head.raw_size)


def list_delta_bases(store: Store, manifest: Manifest) -> None:
    """Add to ``manifest``'s object table the base chain of every delta object it names.

    A save straight into a store that holds deltas (a cold tier written to directly)
    reuses them by content hash like any object; listing their bases is what makes GC
    keep those bases. The writer knows each reused object's codec (from the parent's table
    or the object's header), so a store without deltas costs nothing here.
    """
    for digest, entry in list(manifest.objects.items()):
        if entry.codec != XOR_ID:
            continue
        for h in chain_of(read_header(store, digest).params):
            if h not in manifest.objects:
                manifest.objects[h] = object_entry(store, h)
                store.touch_object(h)  # in use again: GC's grace period covers the save


def before_commit(
    store: Store, manifest: Manifest, *, light: Callable[[], None] | None = None
) -> None:
    """Step 1, once every object is durable: ``light`` (a light checkpoint names its
    base's chunks), then the bases of every delta object the manifest names."""
    if light is not None:
        light()
    list_delta_bases(store, manifest)


def after_commit(store: Store, manifest: Manifest, data: bytes) -> None:
    """Step 3, right after the commit: the summary row and the object list (``data``:
    the manifest as committed; GC's mark reads the list instead of parsing it), and the
    commit becomes the next save's parent (``engine/parent.py``). Never raises: a missing
    row or list only costs a listing or a sweep one parse."""
    record_commit(store, manifest, data)
    record_objects(store, manifest, data)
    remember_commit(store, manifest)


def commit_checkpoint(
    store: Store,
    manifest: Manifest,
    *,
    overwrite: bool = False,
    light: Callable[[], None] | None = None,
) -> bytes:
    """The whole epilogue for a writer whose objects are already durable (the DCP
    coordinator): :func:`before_commit`, the atomic commit, :func:`after_commit`.
    Returns the committed manifest bytes."""
    before_commit(store, manifest, light=light)
    data = serialize_manifest(manifest)
    store.commit_manifest(manifest.run, manifest.step, data, overwrite=overwrite)
    after_commit(store, manifest, data)
    return data


__all__ = [
    "after_commit",
    "before_commit",
    "commit_checkpoint",
    "list_delta_bases",
    "object_entry",
    "read_header",
]
