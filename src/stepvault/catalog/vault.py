"""Read-only access to a store: runs, checkpoints, manifests and lazy tensor reads."""

from __future__ import annotations

from typing import Any

from ..engine import CheckpointReader
from ..format import Manifest, decode_value, parse_manifest
from ..format.record import CheckpointRecord
from ..store import Store
from .reader_holds import holding
from .records import checkpoint_records
from .refs import latest_step, parse_ref


class Checkpoint:
    """One committed checkpoint: metadata at once, tensors on demand (verified when read)."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self._reader = CheckpointReader(store, manifest)

    run = property(lambda self: self.manifest.run)
    step = property(lambda self: self.manifest.step)
    epoch = property(lambda self: self.manifest.epoch)
    metrics = property(lambda self: dict(self.manifest.metrics))

    @property
    def metadata(self) -> Any:
        return decode_value(self.manifest.metadata, lambda kind, name: None)

    @property
    def is_sharded(self) -> bool:
        """True for a checkpoint written by several ranks (torch.distributed.checkpoint)."""
        return bool(self.manifest.sharded)

    def tensor_names(self) -> list[str]:
        """Stored tensor names, e.g. ``model/fc.weight``, ``optimizer/state/0/exp_avg``
        (for a multi-rank checkpoint: DCP's flattened names, e.g. ``model.fc.weight``)."""
        if self.manifest.sharded:
            entries = self.manifest.sharded["entries"]
            return [k for k, e in entries.items() if e["type"] == "tensor"]
        return list(self.manifest.tensors)

    def tensor(self, name: str, *, mmap: bool = False) -> Any:
        """Read one tensor lazily: only its objects are fetched (and verified). Shards of a
        multi-rank checkpoint are assembled into the full tensor.

        ``mmap=True``: zero-copy where the bytes allow it, as in :meth:`load`.
        """
        if self.manifest.sharded:
            return self._reader.read_sharded(name)
        return self._reader.read(name, private=not mmap)

    def load(self, *, mmap: bool = False) -> dict[str, Any]:
        """The whole saved state as plain state dicts (no live objects, no process group).

        Every object is read and verified before any tensor is returned. By default each
        tensor has memory of its own. ``mmap=True`` (for inference, export or evaluation
        jobs that read a checkpoint once): a tensor stored in one raw object on a local
        store is a view of that object's private copy-on-write mapping, like
        ``safetensors.safe_open``: no copy, and writing to it never changes the store.
        Tensors larger than one chunk, objects of another codec (zstd, float) and stores
        that cannot be mapped (fsspec) decode into fresh memory.
        """
        # Held while it reads: no keep policy, thinning or GC of another process takes
        # the checkpoint away mid-read (stepvault.ops.hold).
        with holding(self.store, self.run, self.step, owner="Checkpoint.load"):
            if self.manifest.sharded:
                return self._load_sharded()
            arrays = self._reader.read_all(private=not mmap)
            return decode_value(self.manifest.state, lambda kind, name: arrays[name])

    def _load_sharded(self) -> dict[str, Any]:
        sharded = self.manifest.sharded
        assert sharded is not None  # load() calls this only for a sharded manifest
        paths = sharded.get("paths", {})
        out: dict[str, Any] = {}
        for fqn, e in sharded["entries"].items():
            if e["type"] == "tensor":
                value = self._reader.read_sharded(fqn)
            else:
                value = decode_value(e["value"], lambda kind, name: None)
            path = paths.get(fqn) or [fqn]
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        out.pop("__stepvault_kinds__", None)  # how a collective save recorded its entries
        return out

    def __repr__(self) -> str:
        return f"<Checkpoint {self.run}@{self.step} tensors={len(self.manifest.tensors)}>"


class Vault:
    """A store opened for reading (``stepvault.open(root)``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @property
    def url(self) -> str:
        return self.store.backend.url

    def runs(self) -> list[str]:
        """Run names in the store."""
        return self.store.list_runs()

    def steps(self, run: str) -> list[int]:
        """Committed steps of ``run``, ascending (no manifest is read)."""
        return self.store.list_steps(run)

    def manifest(self, run: str, step: int) -> Manifest:
        """Parsed and checksum-verified manifest of ``run@step``."""
        return parse_manifest(self.store.read_manifest(run, step), f"{run}@{step}")

    def checkpoint(self, run: str, step: int | str | None = "latest") -> Checkpoint:
        """A :class:`Checkpoint`; ``run`` may be a ``RUN@STEP`` reference.

        ``"latest"`` (or no step) is the newest *full* checkpoint of the run, the one a
        plain ``restore`` resumes from; a light or weights-only one is read by its step.
        """
        if "@" in run:
            run, step = parse_ref(run)
        if step in (None, "latest"):
            step = latest_step(self.store, run)
        return Checkpoint(self.store, self.manifest(run, int(step)))

    def checkpoints(self, run: str, steps: list[int] | None = None) -> list[CheckpointRecord]:
        """Records of every checkpoint of ``run`` (damaged manifests show their error);
        only of ``steps`` when given (``stepvault ls --limit``: a page of a long run).

        Every manifest is read and its checksum verified; one that was summarised before
        (same checksum) is not parsed again: its record comes from the run's summary
        cache (see :mod:`stepvault.catalog.summaries`), which makes long runs list fast.
        """
        return checkpoint_records(self.store, run, steps=steps)

    def __repr__(self) -> str:
        return f"<Vault {self.url}>"
