"""An opened checkpoint: its manifest parsed once, a reader over its objects, and its
state tree with meta stand-ins, so that choosing, checking and placing read it once."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ManifestError
from ..format import Manifest, decode_value, parse_manifest
from ..store import Store

if TYPE_CHECKING:  # the reader imports torch; opening a vault for listing does not
    from ..catalog.vault import Vault
    from ..engine import CheckpointReader


@dataclass
class OpenedCheckpoint:
    """``run@step`` opened for reading: nothing but its manifest has been read yet."""

    store: Store
    manifest: Manifest
    reader: CheckpointReader
    #: the saved state tree with meta tensors standing in for the stored ones (no IO)
    meta_tree: Any

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def sharded(self) -> bool:
        """Written by several ranks (read it through DCP)."""
        return bool(self.manifest.sharded)

    def verify_all(self, progress: Callable[[int, int | None], None] | None = None) -> None:
        """Read and verify every object this checkpoint names (the reader keeps them);
        ``progress(done, total)`` gets the stored bytes verified so far."""
        self.reader.prefetch(
            (d for t in self.manifest.tensors.values() for d, _, _ in t.chunks), progress
        )

    def metadata(self) -> Any:
        """The user metadata saved with it."""
        return decode_value(self.manifest.metadata, lambda kind, name: None)

    def release(self) -> None:
        self.reader.release()


def open_checkpoint(
    store: Store, run: str, step: int, *, workers: int | None = None, verify: str = "fast"
) -> OpenedCheckpoint:
    """Parse ``run@step``'s manifest (checksum verified) and open a reader over it.

    ``verify``: ``"fast"`` checks objects with their segment checksums where recorded,
    ``"full"`` with BLAKE3; a signed checkpoint is always read ``"full"`` (its signature
    covers BLAKE3 names; a non-cryptographic checksum could be forged to match)."""
    from ..engine import CheckpointReader
    from ..engine.fetch import check_verify_mode

    mode = check_verify_mode(verify)
    manifest = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    reader = CheckpointReader(store, manifest, workers=workers, verify=mode)  # signed: "full"

    def stand_in(kind: str, name: str) -> Any:
        entry = manifest.tensors.get(name)
        if entry is None or entry.kind != kind:
            raise ManifestError(f"state references unknown {kind} {name!r}")
        return reader.meta(name)

    return OpenedCheckpoint(store, manifest, reader, decode_value(manifest.state, stand_in))


def open_vault(root: str | os.PathLike[str] | Store) -> Vault:
    """Open the store at ``root`` for reading: runs, checkpoints, manifests, lazy tensors
    (of every tier, when the store has cold tiers: see STORAGE.md).

    Reading a store this way does not import torch."""
    from ..catalog.vault import Vault
    from ..tiers.view import read_view

    store = root if isinstance(root, Store) else Store.open(root)
    return Vault(read_view(store))
