"""Disk usage: logical bytes vs what the store really holds (dedup and compression savings)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import StepvaultError
from ..format import parse_manifest
from ..store import Store


@dataclass
class RunUsage:
    run: str
    checkpoints: int = 0
    logical_bytes: int = 0
    unique_stored_bytes: int = 0


@dataclass
class StoreUsage:
    """``logical``: what full copies of every checkpoint would take; ``raw``: unique chunk
    bytes (after dedup, before compression); ``stored``: unique object bytes on the store."""

    runs: list[RunUsage] = field(default_factory=list)
    checkpoints: int = 0
    logical_bytes: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    objects: int = 0
    unreferenced_objects: int = 0
    unreferenced_bytes: int = 0
    unreadable_manifests: int = 0
    #: whether the objects were scanned for unreferenced ones (False: the dashboard's quick
    #: summary; its JSON then says null, not a measured 0)
    unreferenced_scanned: bool = True

    @property
    def dedup_savings(self) -> int:
        # Never negative: the deduplicated bytes include non-tensor state (optimizer
        # settings, RNG, values) that the logical (tensor) bytes do not count.
        return max(0, self.logical_bytes - self.raw_bytes)

    @property
    def compression_savings(self) -> int:
        return self.raw_bytes - self.stored_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoints": self.checkpoints,
            "logical_bytes": self.logical_bytes,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "dedup_savings_bytes": self.dedup_savings,
            "compression_savings_bytes": self.compression_savings,
            "objects": self.objects,
            "unreferenced_objects": self.unreferenced_objects
            if self.unreferenced_scanned
            else None,
            "unreferenced_bytes": self.unreferenced_bytes if self.unreferenced_scanned else None,
            "unreadable_manifests": self.unreadable_manifests,
            "runs": [r.__dict__ for r in self.runs],
        }


def store_usage(store: Store, *, scan_unreferenced: bool = True) -> StoreUsage:
    """Summarise the store from its manifests (and, optionally, a scan of the objects)."""
    usage = StoreUsage()
    seen: dict[str, tuple[int, int]] = {}
    for run in store.list_runs():
        ru = RunUsage(run)
        run_objects: dict[str, int] = {}
        for step in store.list_steps(run):
            try:
                m = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
            except StepvaultError:
                usage.unreadable_manifests += 1
                continue
            ru.checkpoints += 1
            ru.logical_bytes += m.logical_bytes
            for digest, obj in m.objects.items():
                run_objects[digest] = obj.size
                seen[digest] = (obj.raw_size, obj.size)
        ru.unique_stored_bytes = sum(run_objects.values())
        usage.runs.append(ru)
        usage.checkpoints += ru.checkpoints
        usage.logical_bytes += ru.logical_bytes
    usage.objects = len(seen)
    usage.raw_bytes = sum(r for r, _ in seen.values())
    usage.stored_bytes = sum(s for _, s in seen.values())
    usage.unreferenced_scanned = scan_unreferenced
    if scan_unreferenced:
        for digest in store.iter_objects():
            if digest not in seen:
                usage.unreferenced_objects += 1
                try:
                    usage.unreferenced_bytes += store.object_size(digest)
                except FileNotFoundError:
                    pass
    return usage


def usage(root: str | os.PathLike[str]) -> StoreUsage:
    """Logical vs stored bytes of the store, with dedup and compression savings."""
    return store_usage(Store.open(root))


def usage_by_tier(store: Store) -> dict[str, StoreUsage]:
    """Usage of each tier of ``store`` (``"hot"`` is the store itself), deduplicated
    within each tier (an object held by two tiers counts in both: it is paid twice)."""
    from ..tiers.config import Tiers

    tiers = Tiers.of(store)
    return {name: store_usage(tiers[name]) for name in tiers.names}


def usage_of_reachable_tiers(
    store: Store,
) -> tuple[dict[str, StoreUsage], dict[str, str]]:
    """:func:`usage_by_tier` of the tiers that answer, and why each other one did not: one
    unreachable archive does not hide the usage of the rest."""
    from ..errors import StepvaultError
    from ..tiers.config import Tiers

    tiers = Tiers.of(store)
    usage: dict[str, StoreUsage] = {}
    failed: dict[str, str] = {}
    for name in tiers.names:
        try:
            usage[name] = store_usage(tiers[name])
        except (StepvaultError, OSError) as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return usage, failed
