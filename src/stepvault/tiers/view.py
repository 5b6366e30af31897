"""Reading across tiers: one read-only store view over hot and cold tiers, and the catalog
of which tiers hold each checkpoint.

A checkpoint lives in a tier iff its manifest is committed there, so the catalog is the
union of the tiers' manifest listings: it cannot disagree with the tiers, and needs no
index of its own that a crash could leave stale (one LIST per run and tier).

The view prefers hot: a manifest is read from the first tier (hot, then cold tiers in
order) that holds it, and each object from the first tier that has it. Objects are
content-addressed and every byte is hash-verified after decoding, so an object may come
from any tier, whatever its encoding there; a checkpoint only in the archive is read from
the archive, many objects in parallel (the reader's prefetch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFoundError, StepvaultError, StoreNotFoundError
from ..store import Store
from ..store.repository import SETTINGS_KEY
from .config import HOT, TIERS_KEY, Tiers
from .mem import MEM


class TieredView(Store):
    """A read-only Store over every tier of ``tiers`` (writes go to a tier's own store)."""

    def __init__(self, tiers: Tiers, names: Sequence[str] | None = None) -> None:
        super().__init__(tiers.hot.backend, tiers.hot.settings)
        self.tiers = tiers
        self.order = list(names or tiers.names)
        self._usable: dict[str, Store] = {}
        self.unreachable: dict[str, str] = {}
        #: of those, the tiers that answered and hold no store yet (no copy made so far)
        self.absent: set[str] = set()
        #: bytes of objects served per tier since the last :meth:`reset_served` (a
        #: restore reports the tier it mostly came from)
        self.served: dict[str, int] = {}

    def add_source(self, name: str, store: Store, *, before: str = HOT) -> None:
        """Read from ``store`` (any Store, e.g. a peer node's memory) just before tier
        ``before`` in the restore order; every object it serves is verified by the reader."""
        self.tiers._stores[name] = store
        self._usable[name] = store
        if name in self.order:
            self.order.remove(name)
        at = self.order.index(before) if before in self.order else len(self.order)
        self.order.insert(at, name)

    def reset_served(self) -> None:
        self.served = {}

    def _count(self, name: str, nbytes: int) -> None:
        self.served[name] = self.served.get(name, 0) + nbytes

    def _stores(self) -> list[tuple[str, Store]]:
        out = []
        for name in self.order:
            if name in self.unreachable:
                continue
            store = self._usable.get(name)
            if store is None:
                try:
                    store = self._usable[name] = self.tiers.get(name, create=False)
                except (StepvaultError, OSError) as exc:
                    # An unreachable archive must not stop a restore from hot.
                    self.unreachable[name] = str(exc)
                    if isinstance(exc, StoreNotFoundError) and f"missing {SETTINGS_KEY}" in str(
                        exc
                    ):
                        self.absent.add(name)  # reached: nothing copied there yet
                    continue
            out.append((name, store))
        return out

    def where(self, run: str, step: int) -> list[str]:
        """Names of the tiers holding a committed manifest of ``run@step``."""
        key = self.manifest_key(run, step)
        return [n for n, s in self._stores() if s.backend.exists(key)]

    # -- listings: the union of the tiers ------------------------------------------------
    def list_runs(self) -> list[str]:
        runs: set[str] = set()
        for _, store in self._stores():
            runs.update(store.list_runs())
        return sorted(runs)

    def list_steps(self, run: str) -> list[int]:
        steps: set[int] = set()
        for _, store in self._stores():
            steps.update(store.list_steps(run))
        return sorted(steps)

    def steps_by_tier(self, run: str) -> dict[str, list[int]]:
        return {name: store.list_steps(run) for name, store in self._stores()}

    def pinned_steps(self, run: str) -> list[int]:
        steps: set[int] = set()
        for _, store in self._stores():
            steps.update(store.pinned_steps(run))
        return sorted(steps)

    # -- reads: hottest tier first ---------------------------------------------------------
    def read_manifest(self, run: str, step: int) -> bytes:
        for _, store in self._stores():
            try:
                return store.read_manifest(run, step)
            except CheckpointNotFoundError:
                continue
        raise CheckpointNotFoundError(
            f"no committed checkpoint {run}@{step} in any tier of {self.backend.url} "
            f"({', '.join(self.order)})"
        )

    def read_manifests(self, run: str, steps: Sequence[int]) -> Iterator[tuple[int, Any]]:
        """``(step, bytes or error)`` per step, each from the hottest tier that has it:
        each tier's batched read (``Store.read_manifests``) of the steps the tiers before
        it did not have (one read per manifest, not a lookup per step and tier)."""
        steps = list(steps)
        found: dict[int, Any] = {}
        missing = steps
        for _, store in self._stores():
            if not missing:
                break
            absent = []
            for step, data in store.read_manifests(run, missing):
                if isinstance(data, CheckpointNotFoundError):
                    absent.append(step)
                else:  # the bytes, or a manifest that cannot be read safely: final
                    found[step] = data
            missing = absent
        for step in steps:
            if step in found:
                yield step, found[step]
            else:
                yield (
                    step,
                    CheckpointNotFoundError(
                        f"no committed checkpoint {run}@{step} in any tier of {self.backend.url} "
                        f"({', '.join(self.order)})"
                    ),
                )

    def read_run_info(self, run: str) -> dict[str, Any] | None:
        for _, store in self._stores():
            info = store.read_run_info(run)
            if info is not None:
                return info
        return None

    def read_signature(self, run: str, step: int) -> dict[str, Any] | None:
        """The signature next to the manifest that :meth:`read_manifest` returns."""
        key = self.manifest_key(run, step)
        for _, store in self._stores():
            if store.backend.exists(key):
                reader = getattr(store, "read_signature", None)
                return reader(run, step) if reader is not None else None
        return None

    def _first(self, digest: str) -> Store:
        for _, store in self._stores():
            if store.has_object(digest):
                return store
        raise FileNotFoundError(digest)

    def has_object(self, digest: str) -> bool:
        try:
            self._first(digest)
            return True
        except FileNotFoundError:
            return False

    def map_object(self, digest: str) -> memoryview | None:
        # Zero-copy from the local tiers: the mem tier (tmpfs) when the view has one, then hot.
        for name in [n for n in self.order if n in (MEM, HOT)]:
            store = self._usable.get(name) or self.tiers.get(name, create=False)
            try:
                view = store.map_object(digest)
            except FileNotFoundError:
                continue
            if view is not None:
                self._count(name, view.nbytes)
            return view
        return None  # the reader falls back to read_object: the cold tiers

    def read_object(self, digest: str) -> bytes:
        for name, store in self._stores():
            try:
                data = store.read_object(digest)
            except FileNotFoundError:
                continue
            self._count(name, len(data))
            return data
        raise FileNotFoundError(digest)

    def object_size(self, digest: str) -> int:
        return self._first(digest).object_size(digest)

    def object_mtime(self, digest: str) -> float:
        return self._first(digest).object_mtime(digest)

    def quarantine_object(self, digest: str) -> str:
        """Quarantine a damaged object in the tier it was read from (the hottest holder)."""
        self.served = {}  # the attempt failed: the retry's bytes say where it came from
        try:
            return self._first(digest).quarantine_object(digest)
        except FileNotFoundError:
            return f"quarantine/{digest}"

    # -- writes are a tier's business --------------------------------------------------------
    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise StepvaultError(
            "a tiered view is read-only: write to a tier's own store (tiers['hot'], ...)"
        )

    put_object = commit_manifest = delete_manifest = delete_object = _read_only
    pin = unpin = ensure_run = _read_only


def with_mem_tier(store: Store, run: str, mem_root: str | None = None) -> Store:
    """``store``, or a view that reads ``run``'s mem tier on this node first: what a
    manager with ``tiers={"mem": ...}`` committed into node memory (after a crash the
    newest steps may be only there). ``mem_root``: default ``$STEPVAULT_MEM_ROOT`` or
    ``/dev/shm/stepvault``. Every object read from it is verified like any tier's."""
    import os

    from ..store import LocalBackend
    from .mem import default_mem_root, mem_dir

    hot = store.tiers.hot if isinstance(store, TieredView) else store
    try:
        root = os.path.abspath(mem_root) if mem_root else default_mem_root()
        path = mem_dir(root, hot, run)
        if not os.path.isdir(path):
            return store
        mem = Store.open(LocalBackend(path))
        mem.fence_source = (hot, run)  # the run's fence rule applies to memory copies too
        if not mem.list_steps(run):
            return store
    except (StepvaultError, OSError):
        return store  # no readable mem tier here: the tiers as they are
    view = store if isinstance(store, TieredView) else TieredView(Tiers.of(store))
    view.add_source(MEM, mem, before=HOT)
    return view


def read_view(store: Store) -> Store:
    """``store`` itself, or a :class:`TieredView` over its tiers when it has cold tiers."""
    if isinstance(store, TieredView) or not store.backend.exists(TIERS_KEY):
        return store
    tiers = Tiers.of(store)
    return TieredView(tiers) if tiers.cold_names else store


@dataclass
class CatalogEntry:
    run: str
    step: int
    tiers: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "tiers": self.tiers}


def catalog(tiers: Tiers, run: str | None = None) -> list[CatalogEntry]:
    """Every checkpoint of ``run`` (or of every run) with the tiers that hold it, hot first."""
    view = TieredView(tiers)
    runs = [run] if run is not None else view.list_runs()
    out = []
    for name in runs:
        by_tier = view.steps_by_tier(name)
        steps = sorted(set().union(*map(set, by_tier.values()))) if by_tier else []
        for step in steps:
            out.append(
                CatalogEntry(name, step, [t for t in view.order if step in by_tier.get(t, [])])
            )
    return out


#: Parallel object fetches for a restore that reads from an object store: the work is
#: network round trips, not CPU, so many more requests in flight than cores pay off.
REMOTE_READ_WORKERS = 16


def read_workers(store: Store) -> int | None:
    """Reader threads for restoring from ``store``: :data:`REMOTE_READ_WORKERS` when it (or
    any of its tiers) is remote, else None (the engine's CPU-based default)."""
    from ..store import LocalBackend

    stores = [s for _, s in store._stores()] if isinstance(store, TieredView) else [store]
    remote = any(not isinstance(s.backend, LocalBackend) for s in stores)
    return REMOTE_READ_WORKERS if remote else None


def with_copies(store: Store, run: str, steps: list[int]) -> list[int]:
    """Restore candidates with each step listed once per tier that holds it.

    A restore that finds a damaged object quarantines it in the tier it came from (hot
    first) and moves on; trying the same step again then reads that object from the next
    tier that has it, so a good archived copy is used before falling back to an older step.
    """
    if not isinstance(store, TieredView):
        return steps
    counts: dict[int, int] = {}
    for held in store.steps_by_tier(run).values():
        for step in held:
            counts[step] = counts.get(step, 0) + 1
    return [s for step in steps for s in [step] * max(1, counts.get(step, 1))]
